"""GPU leases: an exclusive flock on one file per GPU, in a directory shared by all users.

Why flock: the kernel drops the lock when the last descriptor of the open file goes away, so a
lease vanishes when its holder dies, SIGKILL and OOM-kill included; no pid files to clean up
and no stale leases. A lease is inherited across `exec` (torchplace run hands its leases to the
job it starts) and by forked children, so it lasts as long as a process that may use the GPU.

The directory (``$TORCHPLACE_LEASE_DIR``, default ``/tmp/torchplace-leases``) has mode 1777 like
/tmp: anyone may add a lease file, only its owner (and the directory's owner, and root) may remove
it. Deleting a lock file while it is held is what breaks flock-based locking (the next job locks a
new file of the same name), so the trust model is:

- The directory must be owned by root or by the current user, and every folder above it too
  (others must not be able to rename it away: a folder above may be writable by others only with
  the sticky bit, like /tmp). A shared directory is made by an admin
  (``sudo install -d -m 1777 -o root -g root DIR``); one made by the first user who ran torchplace
  serves that user only, everyone else is refused with that fix.
- The directory and the lease files are opened without following symbolic links (O_NOFOLLOW); a
  directory that others may write without the sticky bit is refused; a lease file must be a
  regular file with one link (no FIFO, device or hard link to someone's file).
- What is left: the first user to lease a GPU owns its lock file for good and may unlink it while
  another user's job holds the lock. That is detected, not prevented: the holder's note records the
  (device, inode) it locked, and a GPU counts as held while any note names an inode that is no
  longer the lock file's and that the kernel still shows locked (/proc/locks). A new holder writes
  its note and then re-checks that the name still points at the file it locked, so an unlink either
  comes before that check (the new holder backs off) or after the note exists (others see it).
  No note, no lease: a note that cannot be written (a full file system) refuses the lease, and its
  name ends in random digits, so nothing planted in the folder can stand in its way.
  `Lease.check()` tells a holder that its file was removed. Lease files are never deleted by
  torchplace.

Who holds a lease is advisory: the holder writes ``<uuid>.holder.<uid>.<random>`` next to the lock,
readers trust a note only when its owner matches the uid in its name, and name it as the holder
only when the kernel's /proc/locks shows its pid (of that user) locking the file the note names.

Memory reservations (`LeaseDir.try_reserve`, `torchplace run --memory`): a reservation holds a shared
flock on the GPU's lock file, where a whole-GPU lease holds an exclusive one, so the kernel never
lets the two overlap; its note, ``<uuid>.memory.<uid>.<random>``, says how many bytes, is trusted
like a holder note, and counts only while /proc/locks shows its pid locking that file. Reservations
fit when all of them add up to at most the GPU's memory less what processes without a lease use
(`unleased_processes`); the queue of waiting jobs is `queue.py`'s, in the same folder.

Here, in order: the folder and its lock files (opened without trusting other users), the holder
notes and the kernel's /proc/locks (who holds a lease), then `Lease`, `LeaseDir` (acquire, status,
list) and this process's registry of its leases.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import secrets
import stat
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import LeaseError, TorchplaceWarning
from ..hardware.host import pid_exists

__all__ = ["DEFAULT_LEASE_DIR", "LEASE_DIR_ENV", "Holder", "Lease", "LeaseDir", "LeaseStatus", "covered",
           "held_by_this_process", "lease_dir", "release_all", "unleased_processes"]

LEASE_DIR_ENV = "TORCHPLACE_LEASE_DIR"
MEMORY_ENV = "TORCHPLACE_MEMORY_RESERVATION"  # bytes reserved on each GPU, handed by `torchplace run` to the job
DEFAULT_LEASE_DIR = "/tmp/torchplace-leases"
LOCK_SUFFIX = ".lock"
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_ADMIN_FIX = "sudo install -d -m 1777 -o root -g root"


def lease_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The lease directory: `path`, else $TORCHPLACE_LEASE_DIR, else /tmp/torchplace-leases."""
    return Path(path or os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


def user_name(uid: int) -> str:
    """The login name of `uid`, or "uid N" when the system has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def plain(text: str, limit: int = 300) -> str:
    """TEXT from another user's file or process, cut to LIMIT characters, its control characters (ESC, bidi
    overrides) written as escapes: shown in this user's messages and tables, never obeyed by the terminal."""
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text[:limit])


def safe_uuid(uuid: str) -> bool:
    """Whether `uuid` can name a file in the lease folder (no path separators, no '..')."""
    return bool(SAFE_NAME.match(uuid)) and ".." not in uuid


def lock_name(uuid: str) -> str:
    """The lock file's name for GPU `uuid`; LeaseError for a UUID that cannot name a file."""
    if not safe_uuid(uuid):
        raise LeaseError(f"GPU UUID {uuid!r} cannot name a lease file (letters, digits, '.', '_', "
                         "':' and '-' only). Fix: pass the UUID NVML reports, e.g. 'GPU-5e3f...'.")
    return uuid + LOCK_SUFFIX


# --------------------------------------------------------------------------- the folder
# The folder must be root's or ours, and so must every folder above it (a folder others may write
# needs the sticky bit); nothing is opened through a symbolic link; a lock file must be a regular
# file with one link.


@contextlib.contextmanager
def open_folder(path: Path, create: bool = True) -> Iterator[int | None]:
    """A descriptor of the checked folder `path` (None when it does not exist and create=False)."""
    created = False
    real = _check_parents(path)
    if create:
        try:
            os.mkdir(real, 0o1777)
            created = True
        except FileExistsError:
            pass
        except OSError as exc:
            raise LeaseError(
                f"Cannot create the lease directory {path}: {exc.strerror}. Fix: an admin "
                f"creates the shared one with `{_ADMIN_FIX} {path}`, or set {LEASE_DIR_ENV} "
                "to a directory of your own.") from None
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise LeaseError(
                f"The lease directory {path} is not a directory (it is a symbolic link or a "
                "file). torchplace does not follow links there, because another user could point "
                f"it at files of yours. Fix: remove {path} (its owner or root) or set "
                f"{LEASE_DIR_ENV} to a real directory.") from None
        raise LeaseError(f"Cannot open the lease directory {path}: {exc.strerror}. Fix: an "
                         f"admin creates the shared one with `{_ADMIN_FIX} {path}`, or set "
                         f"{LEASE_DIR_ENV} to a directory of your own.") from None
    try:
        st = os.fstat(fd)
        if created and st.st_uid == os.getuid():
            os.fchmod(fd, 0o1777)  # mkdir's mode was cut by the umask
            st = os.fstat(fd)
        _check_folder(path, st)
        yield fd
    finally:
        os.close(fd)


def _check_folder(path: Path, st: os.stat_result) -> None:
    mode = stat.S_IMODE(st.st_mode)
    shared = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    if shared and not mode & stat.S_ISVTX:
        raise LeaseError(
            f"The lease directory {path} (owner {user_name(st.st_uid)}, mode {mode:o}) can be "
            "written by other users but lacks the sticky bit, so anyone could delete or replace "
            f"other users' leases. Fix: `chmod 1777 {path}` (its owner or root), or set "
            f"{LEASE_DIR_ENV} to another directory.")
    if not shared and st.st_uid not in (0, os.getuid()):
        # a private directory of someone else: we could not add leases there anyway
        raise LeaseError(
            f"The lease directory {path} belongs to {user_name(st.st_uid)} (mode {mode:o}) and "
            f"only they can add leases there. Fix: an admin replaces it with one made by "
            f"`{_ADMIN_FIX} {path}`, or set {LEASE_DIR_ENV} to a directory of your own.")
    if st.st_uid not in (0, os.getuid()):
        raise LeaseError(
            f"The lease directory {path} is owned by {user_name(st.st_uid)} (mode {mode:o}), "
            f"neither root nor you ({user_name(os.getuid())}).\n"
            f"Fix: an admin removes it and runs `{_ADMIN_FIX} {path}`.\n"
            f"Or: set {LEASE_DIR_ENV} to a directory of your own (then only your jobs see your leases).\n"
            "Why: the owner of a shared folder may unlink other users' lease files, and then two jobs are handed "
            "the same GPU, so torchplace trusts a shared lease folder only if root made it.")


def _check_parents(path: Path) -> Path:
    """`path` with its parent resolved, after checking that no other user can rename or replace
    a folder on the way (each is root's or ours, and sticky if others may write it). The last
    component is not resolved: a symbolic link there is refused."""
    parent = Path(os.path.realpath(path.parent))
    for folder in (parent, *parent.parents):
        try:
            st = os.stat(folder)
        except OSError:
            continue  # missing: creating or opening the directory fails with its own message
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, os.getuid()):
            why = f"belongs to {user_name(st.st_uid)}"
        elif mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
            why = "other users may write without the sticky bit"
        else:
            continue
        raise LeaseError(
            f"The lease directory {path} is inside {folder} (owner {user_name(st.st_uid)}, mode "
            f"{mode:o}), which {why}: another user could rename the lease directory and put one "
            "of their own in its place, and then two jobs are handed the same GPU. Fix: use a "
            "lease directory whose parent folders only root or you can change, e.g. the default "
            f"made by an admin with `{_ADMIN_FIX} {DEFAULT_LEASE_DIR}`, via {LEASE_DIR_ENV}.")
    return parent / path.name


# --------------------------------------------------------------------------- lock files


def open_lock(path: Path, dirfd: int, uuid: str, create: bool) -> int | None:
    """A descriptor of GPU `uuid`'s lock file in the folder `path` open as `dirfd`, created when
    `create`; None when it does not exist. Refuses links, special files and hard links."""
    name = lock_name(uuid)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = None
    if create:
        try:
            fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dirfd)
            os.fchmod(fd, 0o644)  # readable by all, whatever the umask: others lock it read-only
        except FileExistsError:
            fd = None
        except PermissionError:
            raise LeaseError(
                f"Cannot create the lease file {path / name}: permission denied. Fix: make "
                f"{path} writable by all users with the sticky bit (chmod 1777).") from None
    if fd is None:
        try:
            fd = os.open(name, flags, dir_fd=dirfd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _bad_file(path, dirfd, name, exc) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        kind = "a regular file with other hard links" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise LeaseError(
            f"The lease file {path / name} is {kind} (owner {user_name(st.st_uid)}); someone "
            "may be using it to make torchplace touch another file. Refusing to use it. Fix: "
            "its owner or root removes it.")
    return fd


def _bad_file(folder: Path, dirfd: int, name: str, exc: OSError) -> LeaseError:
    path = folder / name
    if exc.errno == errno.ELOOP:
        try:
            owner = user_name(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid)
        except OSError:
            owner = "unknown"
        return LeaseError(
            f"The lease file {path} is a symbolic link (owner {owner}); torchplace does not "
            "follow links in the lease directory, because another user could point one at your "
            "files. Fix: its owner or root removes it.")
    if exc.errno == errno.EACCES:
        return LeaseError(f"Cannot open the lease file {path}: permission denied (it must be "
                          f"readable by all users). Fix: its owner runs `chmod 644 {path}`.")
    return LeaseError(f"Cannot open the lease file {path}: {exc.strerror}.")


def still_named(dirfd: int, uuid: str, locked: tuple[int, int]) -> bool:
    """Whether the lease file's name still points at the file (device, inode) we locked."""
    try:
        now = os.stat(lock_name(uuid), dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == locked


HOLDER_INFIX = ".holder."
RESERVATION_INFIX = ".memory."  # a memory reservation's note: ``<uuid>.memory.<uid>.<random>``
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
    memory_bytes: int | None = None  # a memory reservation; None: the whole GPU

    def describe(self) -> str:
        parts = [f"pid {self.pid}" if self.pid else "an unknown process"]
        if self.user:
            parts.append(f"user {self.user}")
        if self.memory_bytes is not None:
            parts.append(f"reserving {_gib(self.memory_bytes)}")
        if self.since:
            parts.append(f"since {self.since}")
        text = ", ".join(parts)
        return f"{text} ({self.command})" if self.command else text


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


Note = tuple[float, Holder, tuple[int, int] | None]  # (since, who, the (device, inode) it locked)


def now_iso(seconds: float | None = None) -> str:
    """The local time (now, or SECONDS since the epoch) as ISO 8601 with the offset written +00:00."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(seconds))
    return f"{stamp[:-2]}:{stamp[-2:]}"  # +0000 -> +00:00, as ISO 8601 writes it


# --------------------------------------------------------------------------- holder notes
# A note, ``<uuid>.holder.<uid>.<random>``, is trusted only when its owner is the uid its name claims,
# and names the holder only when the kernel's /proc/locks shows its pid locking the file it names.
# A note also records the (device, inode) its writer locked, which is how a lock file unlinked
# under a live holder is still seen as held (`orphan_holder`).


def write_note(dirfd: int, folder: Path, uuid: str, holder: Holder, locked: tuple[int, int],
               infix: str = HOLDER_INFIX) -> str:
    """Write the holder note into a new file of a name no one can guess, ``<uuid>.holder.<uid>.<random>``
    (O_EXCL, O_NOFOLLOW: nothing planted under a name can take its place), and return that name.

    A lease is granted only with its note: the note is what shows the GPU held once its lock file is
    unlinked (`orphan_holder`), so a note that cannot be written (a full file system, a quota) raises
    LeaseError naming the folder and the fix instead."""
    data = json.dumps({**asdict(holder), "since_epoch": time.time(),
                       "lock_dev": locked[0], "lock_ino": locked[1]}).encode()
    try:
        name, fd = new_file(dirfd, f"{uuid}{infix}{os.getuid()}.")
    except OSError as exc:
        problem = exc
    else:
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            os.fsync(fd)  # file systems that report a full disk only when the data goes out
            return name
        except OSError as exc:
            problem = exc
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
        finally:
            os.close(fd)
    why = problem.strerror or str(problem)
    raise LeaseError(
        f"Cannot write the holder note of GPU {uuid} in the lease directory {folder} ({why}), so the GPU "
        "is not leased: without its note a lease cannot be told apart from a free GPU once someone removes "
        f"its lock file. Fix: free space in the file system of {folder} (`df {folder}`), or set "
        f"{LEASE_DIR_ENV} to a directory on a file system with room.")


def new_file(dirfd: int, prefix: str) -> tuple[str, int]:
    """(name, fd) of a new file ``<prefix><random>`` in DIRFD, readable by all, writable by us: made with O_EXCL
    and O_NOFOLLOW, so nothing planted under a name can take its place; a taken name (someone's file, folder
    or link) draws another. Raises the OSError that stopped it."""
    problem: OSError | None = None
    for _ in range(8):
        name = f"{prefix}{secrets.token_hex(8)}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dirfd)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.EISDIR, errno.ELOOP):
                raise
            problem = exc
            continue
        try:
            os.fchmod(fd, 0o644)  # whatever the umask: others read notes and entries to see who holds or waits
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dirfd)
            raise
        return name, fd
    assert problem is not None
    raise problem


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


def notes(dirfd: int, uuid: str, infix: str = HOLDER_INFIX) -> list[Note]:
    """The trusted holder notes (or, with RESERVATION_INFIX, memory notes) of GPU `uuid` in the
    folder open as `dirfd`."""
    found = []
    prefix = uuid + infix
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


def orphan_holder(dirfd: int, uuid: str, named: tuple[int, int] | None, *, whole_only: bool = False) -> Holder | None:
    """A live holder of `uuid` whose lock file was unlinked under it: a note of it names a
    (device, inode) that is not the lock file `named` (nor any other lease file here) and
    that the kernel shows locked. None when there is none."""
    by_lock: dict[tuple[int, int], list[Holder]] = {}
    shared = [] if whole_only else notes(dirfd, uuid, RESERVATION_INFIX)  # reservations may share with reservations
    for _, holder, lock in notes(dirfd, uuid) + shared:
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
        if pids is None:
            alive = [h for h in holders if h.pid and pid_exists(h.pid)]
            if alive:
                return alive[0]
            continue
        # the locker must be the note's writer: a freed inode number soon names another file that anyone
        # may lock (and overlayfs is matched by inode number only); a pid the kernel hides counts as held
        if (found := _writer(holders, pids)) is not None or any(p <= 0 for p in pids):
            return found or holders[0]
    return None


def reservations(dirfd: int, uuid: str, named: tuple[int, int] | None) -> list[Holder]:
    """The live memory reservations on GPU `uuid`'s lock file `named` (device, inode), or with None
    on any file of that GPU (one unlinked under its holders included): memory notes whose pid the
    kernel shows locking the file they name (a shared flock) and whose writer is that process's
    user. A reservation SIGKILLed leaves its note, and is not counted."""
    by_lock: dict[tuple[int, int], list[Holder]] = {}
    for _, holder, lock in notes(dirfd, uuid, RESERVATION_INFIX):
        if lock is not None and (named is None or lock == named):
            by_lock.setdefault(lock, []).append(holder)
    live = []
    for lock, found in by_lock.items():
        pids = proc_locks(*lock)
        live += [h for h in found if h.pid and (pid_exists(h.pid) if pids is None else
                                                h.pid in pids and _uid_of(h.pid) in (None, h.uid))]
    return sorted(live, key=lambda h: (h.since or "", h.pid or 0))


def _clear_dead_reservations(dirfd: int, uuid: str, locked: tuple[int, int]) -> None:
    """Remove this user's memory notes of `locked` whose writer no longer locks it (killed)."""
    pids = proc_locks(*locked)
    if pids is None:
        return
    prefix = f"{uuid}{RESERVATION_INFIX}{os.getuid()}."
    for name in os.listdir(dirfd):
        if name.startswith(prefix):
            note = _read_note(dirfd, name, str(os.getuid()))
            if note is not None and note[2] == locked and note[1].pid not in pids:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dirfd)


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def covered(pid: int, holder_pids: set[int]) -> bool:
    """Whether process `pid` is a lease holder or runs under one (torchrun's workers under the
    leased launcher), read from /proc's parent links."""
    for _ in range(64):
        if pid in holder_pids:
            return True
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def _vouched(holders: list[Holder], pids: list[int]) -> Holder:
    """Of the notes naming one locked file, the one whose pid the kernel shows locking it and whose
    writer is that process's user (a stale note, or one another user wrote naming our pid, is not);
    else what the OS says about the kernel's pid."""
    live = [p for p in pids if p > 0]
    return (_writer(holders, live) or (_holder_from_pid(live[0]) if live else None)
            or Holder(pid=None, source="/proc/locks"))


def _writer(holders: list[Holder], pids: list[int]) -> Holder | None:
    """The note whose pid is one the kernel shows and whose writer is that process's user, or None."""
    for pid in (p for p in pids if p > 0):
        uid = _uid_of(pid)
        for holder in holders:
            if holder.pid == pid and (uid is None or holder.uid == uid):
                return holder
    return None


def read_owned(dirfd: int, name: str, uid_text: str) -> tuple[Any, os.stat_result] | None:
    """(the JSON object, its stat) of file NAME in DIRFD, only if it is a regular file of at most 64 KiB owned
    by the uid UID_TEXT its name claims (opened without following links or blocking on a FIFO); else None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or str(st.st_uid) != uid_text or st.st_size > 65536:
            return None
        raw = json.loads(os.read(fd, 65536).decode() or "null")
        return (raw, st) if isinstance(raw, dict) else None
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


def _read_note(dirfd: int, name: str, uid_text: str) -> Note | None:
    """A holder note (when, who, the (device, inode) it locked), trusted only if the file's owner
    is the uid its name claims."""
    if (owned := read_owned(dirfd, name, uid_text)) is None:
        return None
    raw, st = owned
    try:
        fields = {k: raw.get(k) for k in ("pid", "user", "uid", "hostname", "since", "command", "memory_bytes")}
        if fields["uid"] != st.st_uid or not isinstance(fields["pid"], int):
            return None
        fields["user"] = user_name(st.st_uid)  # the owner's name, not the one the note claims
        for key in ("hostname", "since", "command"):
            fields[key] = None if fields[key] is None else plain(str(fields[key]))
        if fields["memory_bytes"] is not None and (type(fields["memory_bytes"]) is not int
                                                   or fields["memory_bytes"] < 1):
            return None
        dev, ino = raw.get("lock_dev"), raw.get("lock_ino")
        lock = (dev, ino) if type(dev) is int and type(ino) is int and dev >= 0 and ino > 0 else None
        return float(raw.get("since_epoch") or 0), Holder(**fields), lock
    except (ValueError, TypeError, AttributeError, OverflowError):
        return None


def _holder_from_pid(pid: int) -> Holder:
    """What the OS says about a pid, when the holder left no note."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            command = plain(fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:300]) or None
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


# --------------------------------------------------------------------------- leases

_registry_lock = threading.Lock()
_held: dict[tuple[str, str], Lease] = {}  # (directory, uuid) -> lease held by this process


@dataclass(frozen=True)
class LeaseStatus:
    """One lease file: the GPU it guards, whether it is held now, and by whom."""

    uuid: str
    held: bool
    holder: Holder | None
    path: str
    mine: bool = False  # held by this very process
    reservations: tuple[Holder, ...] = ()  # memory reservations sharing the GPU (then holder is None)

    @property
    def whole(self) -> bool:
        """Held as a whole GPU (not shared by memory reservations)."""
        return self.held and not self.reservations and not (self.holder and self.holder.memory_bytes)

    @property
    def reserved_bytes(self) -> int:
        return sum(h.memory_bytes or 0 for h in self.reservations)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Lease:
    """One GPU leased to this process: an open file with an exclusive flock on it.

    Held until `release()`, the end of a ``with`` block, or the end of the process (and of any
    process that inherited it through fork or exec).
    """

    def __init__(self, uuid: str, directory: Path, fd: int, holder: Holder, holder_file: str | None):
        self.uuid = uuid
        self.directory = directory
        self.holder = holder
        self._fd: int | None = fd
        self._holder_file = holder_file

    @property
    def path(self) -> Path:
        return self.directory / lock_name(self.uuid)

    @property
    def active(self) -> bool:
        return self._fd is not None

    @property
    def memory_bytes(self) -> int | None:
        """The memory this lease reserves on its GPU; None: the whole GPU."""
        return self.holder.memory_bytes

    def fileno(self) -> int:
        if self._fd is None:
            raise LeaseError(f"The lease on {self.uuid} was already released.")
        return self._fd

    def keep_across_exec(self) -> int:
        """Let the lease survive `exec` (torchplace run hands it to the job); returns the fd."""
        fd = self.fileno()
        os.set_inheritable(fd, True)
        return fd

    def check(self) -> None:
        """Raise LeaseError when the lease file was removed or replaced under us (tampering)."""
        fd = self.fileno()
        mine = os.fstat(fd)
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if mine.st_nlink == 0 or now is None or (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            raise LeaseError(
                f"The lease file {self.path} for GPU {self.uuid} was removed or replaced while this "
                f"process (pid {os.getpid()}) held it, so another process may now lease the same GPU. "
                "Only its owner or root can do that in a sticky directory. Fix: find who removes "
                f"files in {self.directory}, or use a private lease directory (${LEASE_DIR_ENV}).")

    def release(self) -> None:
        """Give the GPU back (idempotent). Removes our holder note first, then unlocks."""
        with _registry_lock:
            _held.pop((str(self.directory), self.uuid), None)
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if self._holder_file:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / self._holder_file)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # also for copies inherited by forked children
        os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.active else "released"
        return f"Lease({self.uuid!r}, {state}, {self.path})"


class LeaseDir:
    """The shared lease directory, checked against tampering each time it is opened."""

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = lease_dir(path)

    def try_acquire(self, uuid: str, *, command: str | None = None) -> Lease | None:
        """Lease GPU `uuid` to this process now, or return None when someone holds it.

        Never blocks. A GPU already leased by this process counts as held (None).
        """
        key = (str(self.path), uuid)
        with _registry_lock:
            if key in _held:
                return None
        with open_folder(self.path, create=True) as dirfd:
            assert dirfd is not None
            fd = open_lock(self.path, dirfd, uuid, create=True)
            if fd is None:  # removed between create and open: treat as busy, the caller retries
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            mine = os.fstat(fd)
            locked = (mine.st_dev, mine.st_ino)
            # the file we locked was unlinked or replaced, or a live holder still locks an older
            # file of this GPU that someone unlinked: either way, not a lease
            if (not still_named(dirfd, uuid, locked)
                    or orphan_holder(dirfd, uuid, locked) is not None):
                os.close(fd)
                return None
            holder = Holder(pid=os.getpid(), user=user_name(os.getuid()), uid=os.getuid(),
                            hostname=os.uname().nodename, since=now_iso(),
                            command=(command or " ".join(sys.argv))[:300])
            try:  # no note, no lease: see write_note
                holder_file = write_note(dirfd, self.path, uuid, holder, locked)
            except LeaseError:
                os.close(fd)
                raise
            if not still_named(dirfd, uuid, locked):  # unlinked while we wrote the note
                with contextlib.suppress(OSError):
                    os.unlink(holder_file, dir_fd=dirfd)
                os.close(fd)
                return None
            clear_stale(dirfd, uuid, locked, keep=holder_file)
        lease = Lease(uuid, self.path, fd, holder, holder_file)
        with _registry_lock:
            _held[key] = lease
        return lease

    def status(self, uuid: str) -> LeaseStatus:
        """Whether GPU `uuid` is leased now and by whom; never takes the lease."""
        path = str(self.path / lock_name(uuid))
        with _registry_lock:
            mine = _held.get((str(self.path), uuid))
        if mine is not None and mine.active and mine.memory_bytes is None:
            return LeaseStatus(uuid, True, mine.holder, path, mine=True)
        with open_folder(self.path, create=False) as dirfd:
            if dirfd is None:
                return LeaseStatus(uuid, False, None, path)
            fd = open_lock(self.path, dirfd, uuid, create=False)
            held, holder, named = False, None, None
            if fd is not None:
                try:
                    held, kernel_pid = is_locked(fd)
                    st = os.fstat(fd)
                    named = (st.st_dev, st.st_ino)
                    holder = read_holder(dirfd, uuid, kernel_pid, named) if held else None
                finally:
                    os.close(fd)
            shared = tuple(reservations(dirfd, uuid, named)) if held and named else ()
            if shared:
                holder = None
            if not held:  # the lock file may have been unlinked under a live holder
                holder = orphan_holder(dirfd, uuid, named)
                held = holder is not None
        return LeaseStatus(uuid, held, holder, path, mine=mine is not None and mine.active, reservations=shared)

    def try_reserve(self, uuid: str, nbytes: int, capacity: int, *, command: str | None = None) -> Lease | None:
        """Reserve `nbytes` of GPU `uuid` for this process, or None when that does not fit now.

        The reservation holds a shared flock on the GPU's lock file (a whole-GPU lease holds an
        exclusive one, so the kernel keeps the two apart) and a memory note saying how much. It
        fits when every live reservation of the GPU, this one and those still being made
        included, adds up to at most `capacity` bytes: each maker writes its note before it
        counts, so of two makers racing, the later counter sees both (both may back off; never
        both stay). Never blocks."""
        key = (str(self.path), uuid)
        with _registry_lock:
            if key in _held:
                return None
        if nbytes < 1:
            raise LeaseError(f"A memory reservation of {nbytes} bytes reserves nothing. Fix: ask for e.g. 20GiB.")
        with open_folder(self.path, create=True) as dirfd:
            assert dirfd is not None
            fd = open_lock(self.path, dirfd, uuid, create=True)
            if fd is None:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # leased whole
                os.close(fd)
                return None
            mine = os.fstat(fd)
            locked = (mine.st_dev, mine.st_ino)
            if (not still_named(dirfd, uuid, locked)
                    or orphan_holder(dirfd, uuid, locked, whole_only=True) is not None):
                os.close(fd)
                return None
            _clear_dead_reservations(dirfd, uuid, locked)
            holder = Holder(pid=os.getpid(), user=user_name(os.getuid()), uid=os.getuid(),
                            hostname=os.uname().nodename, since=now_iso(),
                            command=(command or " ".join(sys.argv))[:300], memory_bytes=int(nbytes))
            try:
                note = write_note(dirfd, self.path, uuid, holder, locked, infix=RESERVATION_INFIX)
            except LeaseError:
                os.close(fd)
                raise
            # all of the GPU's reservations, also those on a lock file someone unlinked under them
            taken = sum(h.memory_bytes or 0 for h in reservations(dirfd, uuid, None))
            if taken > capacity or not still_named(dirfd, uuid, locked):
                with contextlib.suppress(OSError):
                    os.unlink(note, dir_fd=dirfd)
                os.close(fd)
                return None
        lease = Lease(uuid, self.path, fd, holder, note)
        with _registry_lock:
            _held[key] = lease
        return lease

    def list(self) -> list[LeaseStatus]:
        """Every lease file in the directory, held or not, sorted by UUID; also GPUs whose lock
        file was unlinked while a live holder still locks it."""
        with open_folder(self.path, create=False) as dirfd:
            if dirfd is None:
                return []
            names = os.listdir(dirfd)
        uuids = {n[: -len(LOCK_SUFFIX)] for n in names if n.endswith(LOCK_SUFFIX)}
        noted = {n.partition(HOLDER_INFIX)[0] for n in names if HOLDER_INFIX in n} - uuids
        statuses = [s for s in (self._listed(u) for u in sorted(uuids) if safe_uuid(u)) if s is not None]
        statuses += [s for s in (self._listed(u) for u in sorted(noted) if safe_uuid(u)) if s is not None and s.held]
        return sorted(statuses, key=lambda s: s.uuid)

    def _listed(self, uuid: str) -> LeaseStatus | None:
        """`status(uuid)` for the listing; None, with a warning, for a lock file it refuses (a link or a FIFO
        another user planted): one such file does not hide every other GPU's lease."""
        try:
            return self.status(uuid)
        except LeaseError as exc:
            warnings.warn(str(exc), TorchplaceWarning, stacklevel=3)
            return None


def held_by_this_process() -> list[Lease]:
    """The leases this process holds now."""
    with _registry_lock:
        return [lease for lease in _held.values() if lease.active]


def release_all() -> None:
    """Release every lease this process holds."""
    for lease in held_by_this_process():
        lease.release()


def lease_pids(status: LeaseStatus) -> set[int]:
    """The pids that hold `status`'s GPU: its whole-GPU holder or its memory reservations."""
    return {h.pid for h in ((status.holder,) if status.holder else ()) + status.reservations if h.pid}


def unleased_processes(topology: Any, folder: LeaseDir | None = None,
                       statuses: dict[str, LeaseStatus] | None = None) -> list[tuple[Any, Any]]:
    """NVML's processes on each GPU of `topology` that no lease of that GPU covers (neither a holder
    nor running under one): (GpuRecord, GpuProcess) pairs, for `leases`, `doctor` and `pick`."""
    if statuses is None:
        statuses = {s.uuid: s for s in (folder or LeaseDir()).list()}
    out = []
    for gpu in topology.gpus:
        status = statuses.get(gpu.uuid)
        holders = lease_pids(status) if status is not None else set()
        out += [(gpu, p) for p in gpu.processes or [] if not covered(p.pid, holders)]
    return out
