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

Here: `Lease`, `LeaseDir` (acquire, status, list) and this process's registry of its leases. The
folder and lock-file checks are in `lease_folder.py`, the holder notes and /proc/locks in
`lease_holders.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..errors import LeaseError
from .lease_folder import (
    DEFAULT_LEASE_DIR,
    LEASE_DIR_ENV,
    LOCK_SUFFIX,
    lease_dir,
    lock_name,
    open_folder,
    open_lock,
    safe_uuid,
    still_named,
    user_name,
)
from .lease_holders import (
    HOLDER_INFIX,
    Holder,
    clear_stale,
    is_locked,
    now_iso,
    orphan_holder,
    read_holder,
    write_note,
)

__all__ = ["DEFAULT_LEASE_DIR", "LEASE_DIR_ENV", "Holder", "Lease", "LeaseDir", "LeaseStatus",
           "held_by_this_process", "lease_dir", "release_all"]

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
        if mine is not None and mine.active:
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
            if not held:  # the lock file may have been unlinked under a live holder
                holder = orphan_holder(dirfd, uuid, named)
                held = holder is not None
        return LeaseStatus(uuid, held, holder, path)

    def list(self) -> list[LeaseStatus]:
        """Every lease file in the directory, held or not, sorted by UUID; also GPUs whose lock
        file was unlinked while a live holder still locks it."""
        with open_folder(self.path, create=False) as dirfd:
            if dirfd is None:
                return []
            names = os.listdir(dirfd)
        uuids = {n[: -len(LOCK_SUFFIX)] for n in names if n.endswith(LOCK_SUFFIX)}
        noted = {n.partition(HOLDER_INFIX)[0] for n in names if HOLDER_INFIX in n} - uuids
        statuses = [self.status(u) for u in sorted(uuids) if safe_uuid(u)]
        statuses += [s for s in (self.status(u) for u in sorted(noted) if safe_uuid(u)) if s.held]
        return sorted(statuses, key=lambda s: s.uuid)


def held_by_this_process() -> list[Lease]:
    """The leases this process holds now."""
    with _registry_lock:
        return [lease for lease in _held.values() if lease.active]


def release_all() -> None:
    """Release every lease this process holds."""
    for lease in held_by_this_process():
        lease.release()
