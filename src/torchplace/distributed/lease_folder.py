"""The shared lease folder and its lock files, opened without trusting other users.

The folder must be root's or ours, and so must every folder above it (a folder others may write
needs the sticky bit); nothing is opened through a symbolic link; a lock file must be a regular
file with one link. `lease.py`'s docstring gives the whole trust model.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import LeaseError

LEASE_DIR_ENV = "TORCHPLACE_LEASE_DIR"
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
            f"neither root nor you ({user_name(os.getuid())}). The owner of a shared folder may "
            "unlink other users' lease files, and then two jobs are handed the same GPU, so "
            "torchplace trusts a shared lease folder only if root made it. Fix: an admin removes "
            f"it and runs `{_ADMIN_FIX} {path}`, or set {LEASE_DIR_ENV} to a directory of "
            "your own (then only your jobs see your leases).")


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
