"""GPU leases: an exclusive flock on one file per GPU, in a directory shared by all users.

Why flock: the kernel drops the lock when the last descriptor of the open file goes away, so a
lease vanishes when its holder dies, SIGKILL and OOM-kill included; no pid files to clean up
and no stale leases. A lease is inherited across `exec` (torchplace run hands its leases to the
job it starts) and by forked children, so it lasts as long as a process that may use the GPU.

The directory (``$TORCHPLACE_LEASE_DIR``, default ``/tmp/torchplace-leases``) is created with
mode 1777 like /tmp: anyone may add a lease file, only its owner may remove it. What is checked
against another user's tampering: the directory and the lease files are opened without
following symbolic links (O_NOFOLLOW); a directory that others may write without the sticky bit
is refused; a lease file must be a regular file with one link (no FIFO, device or hard link to
someone's file); after locking, the name must still point at the locked file. Lease files are
never deleted by torchplace (deleting a lock file is what breaks flock-based locking).

Who holds a lease is advisory: the holder writes ``<uuid>.holder.<uid>`` next to the lock,
readers trust it only when its owner matches the uid in its name, and cross-check the pid with
the kernel's /proc/locks.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pwd
import re
import stat
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from ..errors import LeaseError
from ..hardware.host import pid_exists

LEASE_DIR_ENV = "TORCHPLACE_LEASE_DIR"
DEFAULT_LEASE_DIR = "/tmp/torchplace-leases"
_LOCK_SUFFIX = ".lock"
_HOLDER_INFIX = ".holder."
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

_registry_lock = threading.Lock()
_held: dict[tuple[str, str], "Lease"] = {}  # (directory, uuid) -> lease held by this process


def lease_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The lease directory: `path`, else $TORCHPLACE_LEASE_DIR, else /tmp/torchplace-leases."""
    return Path(path or os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR)


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _lock_name(uuid: str) -> str:
    if not _SAFE_NAME.match(uuid) or ".." in uuid:
        raise LeaseError(f"GPU UUID {uuid!r} cannot name a lease file (letters, digits, '.', '_', "
                         "':' and '-' only). Fix: pass the UUID NVML reports, e.g. 'GPU-5e3f...'.")
    return uuid + _LOCK_SUFFIX


def _now_iso() -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    return f"{stamp[:-2]}:{stamp[-2:]}"  # +0000 -> +00:00, as ISO 8601 writes it


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


@dataclass(frozen=True)
class LeaseStatus:
    """One lease file: the GPU it guards, whether it is held now, and by whom."""

    uuid: str
    held: bool
    holder: Holder | None
    path: str
    mine: bool = False  # held by this very process

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
        return self.directory / _lock_name(self.uuid)

    @property
    def active(self) -> bool:
        return self._fd is not None

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

    def __enter__(self) -> "Lease":
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

    # ----------------------------------------------------------------- directory

    @contextlib.contextmanager
    def _open(self, create: bool = True) -> Iterator[int | None]:
        """A descriptor of the checked directory (None when it does not exist and create=False)."""
        created = False
        if create:
            try:
                os.mkdir(self.path, 0o1777)
                created = True
            except FileExistsError:
                pass
            except OSError as exc:
                raise LeaseError(
                    f"Cannot create the lease directory {self.path}: {exc.strerror}. Fix: set "
                    f"{LEASE_DIR_ENV} to a directory all users of this machine can write, e.g. one "
                    "made with `install -d -m 1777 DIR`.") from None
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if create:
                raise
            yield None
            return
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise LeaseError(
                    f"The lease directory {self.path} is not a directory (it is a symbolic link or a "
                    "file). torchplace does not follow links there, because another user could point "
                    f"it at files of yours. Fix: remove {self.path} (its owner or root) or set "
                    f"{LEASE_DIR_ENV} to a real directory.") from None
            raise LeaseError(f"Cannot open the lease directory {self.path}: {exc.strerror}.") from None
        try:
            st = os.fstat(fd)
            if created and st.st_uid == os.getuid():
                os.fchmod(fd, 0o1777)  # mkdir's mode was cut by the umask
                st = os.fstat(fd)
            self._check_dir(st)
            yield fd
        finally:
            os.close(fd)

    def _check_dir(self, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        shared = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
        if shared and not mode & stat.S_ISVTX:
            raise LeaseError(
                f"The lease directory {self.path} (owner {_user(st.st_uid)}, mode {mode:o}) can be "
                "written by other users but lacks the sticky bit, so anyone could delete or replace "
                f"other users' leases. Fix: `chmod 1777 {self.path}` (its owner or root), or set "
                f"{LEASE_DIR_ENV} to another directory.")
        if not shared and st.st_uid not in (0, os.getuid()):
            # a private directory of someone else: we could not add leases there anyway
            raise LeaseError(
                f"The lease directory {self.path} belongs to {_user(st.st_uid)} (mode {mode:o}) and "
                f"only they can add leases there. Fix: ask them or root to `chmod 1777 {self.path}`, "
                f"or set {LEASE_DIR_ENV} to a directory shared by all users.")

    # ----------------------------------------------------------------- lease files

    def _open_lock(self, dirfd: int, uuid: str, create: bool) -> int | None:
        name = _lock_name(uuid)
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
                    f"Cannot create the lease file {self.path / name}: permission denied. Fix: make "
                    f"{self.path} writable by all users with the sticky bit (chmod 1777).") from None
        if fd is None:
            try:
                fd = os.open(name, flags, dir_fd=dirfd)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise self._bad_file(dirfd, name, exc) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            kind = "a regular file with other hard links" if stat.S_ISREG(st.st_mode) else "not a regular file"
            raise LeaseError(
                f"The lease file {self.path / name} is {kind} (owner {_user(st.st_uid)}); someone "
                "may be using it to make torchplace touch another file. Refusing to use it. Fix: "
                "its owner or root removes it.")
        return fd

    def _bad_file(self, dirfd: int, name: str, exc: OSError) -> LeaseError:
        path = self.path / name
        if exc.errno == errno.ELOOP:
            try:
                owner = _user(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_uid)
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

    def try_acquire(self, uuid: str, *, command: str | None = None) -> Lease | None:
        """Lease GPU `uuid` to this process now, or return None when someone holds it.

        Never blocks. A GPU already leased by this process counts as held (None).
        """
        key = (str(self.path), uuid)
        with _registry_lock:
            if key in _held:
                return None
        with self._open(create=True) as dirfd:
            assert dirfd is not None
            fd = self._open_lock(dirfd, uuid, create=True)
            if fd is None:  # removed between create and open: treat as busy, the caller retries
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            mine = os.fstat(fd)
            try:
                now = os.stat(_lock_name(uuid), dir_fd=dirfd, follow_symlinks=False)
                same = (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)
            except FileNotFoundError:
                same = False
            if not same:  # the file we locked was unlinked or replaced: not a lease
                os.close(fd)
                return None
            holder = Holder(pid=os.getpid(), user=_user(os.getuid()), uid=os.getuid(),
                            hostname=os.uname().nodename, since=_now_iso(),
                            command=(command or " ".join(sys.argv))[:300])
            holder_file = self._write_holder(dirfd, uuid, holder)
        lease = Lease(uuid, self.path, fd, holder, holder_file)
        with _registry_lock:
            _held[key] = lease
        return lease

    def _write_holder(self, dirfd: int, uuid: str, holder: Holder) -> str | None:
        """Write the advisory holder note atomically; None when another user's file blocks it."""
        final = f"{uuid}{_HOLDER_INFIX}{os.getuid()}"
        tmp = f".{final}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        data = json.dumps({**asdict(holder), "since_epoch": time.time()}).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644, dir_fd=dirfd)
            try:
                os.fchmod(fd, 0o644)
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, final, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            return final
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dirfd)
            return None

    # ----------------------------------------------------------------- reading

    def status(self, uuid: str) -> LeaseStatus:
        """Whether GPU `uuid` is leased now and by whom; never takes the lease."""
        path = str(self.path / _lock_name(uuid))
        with _registry_lock:
            mine = _held.get((str(self.path), uuid))
        if mine is not None and mine.active:
            return LeaseStatus(uuid, True, mine.holder, path, mine=True)
        with self._open(create=False) as dirfd:
            if dirfd is None:
                return LeaseStatus(uuid, False, None, path)
            fd = self._open_lock(dirfd, uuid, create=False)
            if fd is None:
                return LeaseStatus(uuid, False, None, path)
            try:
                held, kernel_pid = _is_locked(fd)
                holder = self._read_holder(dirfd, uuid, kernel_pid) if held else None
            finally:
                os.close(fd)
        return LeaseStatus(uuid, held, holder, path)

    def list(self) -> list[LeaseStatus]:
        """Every lease file in the directory, held or not, sorted by UUID."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        uuids = sorted(n[: -len(_LOCK_SUFFIX)] for n in names
                       if n.endswith(_LOCK_SUFFIX) and _SAFE_NAME.match(n[: -len(_LOCK_SUFFIX)]))
        return [self.status(u) for u in uuids]

    def _read_holder(self, dirfd: int, uuid: str, kernel_pid: int | None) -> Holder | None:
        notes: list[tuple[float, Holder]] = []
        prefix = uuid + _HOLDER_INFIX
        for name in os.listdir(dirfd):
            if not name.startswith(prefix):
                continue
            note = _read_note(dirfd, name, name[len(prefix):])
            if note is not None:
                notes.append(note)
        if kernel_pid:
            for _, holder in notes:
                if holder.pid == kernel_pid:
                    return holder
            return _holder_from_pid(kernel_pid)
        alive = [(t, h) for t, h in notes if h.pid and pid_exists(h.pid)]
        return max(alive, key=lambda item: item[0])[1] if alive else None


def _read_note(dirfd: int, name: str, uid_text: str) -> tuple[float, Holder] | None:
    """A holder note, trusted only if the file's owner is the uid its name claims."""
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
        return float(raw.get("since_epoch") or 0), Holder(**fields)
    except (OSError, ValueError, TypeError):
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
    return Holder(pid=pid, user=_user(uid), uid=uid, command=command, source="/proc/locks")


def _proc_locks(dev: int, ino: int) -> list[int] | None:
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


def _is_locked(fd: int) -> tuple[bool, int | None]:
    """(held, pid of the holder if the kernel says). Uses /proc/locks so that reading never
    disturbs a concurrent acquirer; falls back to a shared-lock probe where it is unreadable."""
    st = os.fstat(fd)
    pids = _proc_locks(st.st_dev, st.st_ino)
    if pids is not None:
        return (bool(pids), next((p for p in pids if p > 0), None))
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False, None


def held_by_this_process() -> list[Lease]:
    """The leases this process holds now."""
    with _registry_lock:
        return [lease for lease in _held.values() if lease.active]


def release_all() -> None:
    """Release every lease this process holds."""
    for lease in held_by_this_process():
        lease.release()
