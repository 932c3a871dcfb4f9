"""Keep the last N checkpoints of a directory and a `latest` pointer; find the newest complete one.

Checkpoints saved with `keep_last` (or `latest=True`) carry `"rotation": true` and a `"sequence"`
number in their metadata: they form the directory's rotation series. A new member's sequence is
1 + the largest found in the headers of the series already in the directory. After it is durable,
the series is read back from the headers, ordered by sequence, the `latest` pointer is replaced
atomically, and only then are the oldest beyond N deleted. Rotation never deletes a file that is
not part of the series (other files of the directory are safe), and a writer killed between its
rename and the pointer update leaves nothing behind for good: the next save finds that checkpoint
in the directory and counts it. The pointer is a small JSON file named `latest`:

    {"format": "torchplace-latest/1", "latest": "step-300.safetensors",
     "history": ["step-200.safetensors", "step-300.safetensors"]}

The name `latest` is reserved: `save` refuses to write a checkpoint under it, and rotation refuses
(before writing anything) to replace a `latest` that is not a pointer, so no checkpoint is ever
overwritten by one. Loading the pointer file loads the newest checkpoint of its directory.

Order is the sequence number, never wall time: a clock stepped back (NTP, a migrated VM) cannot
make rotation delete the newest checkpoints or resuming pick an old one. Checkpoints without a
sequence (saved by an older torchplace, or without keep_last / latest=True) rank below every one
that has one, and among themselves follow their recorded creation time, the only order they carry.
Two writers in one directory (two jobs started by mistake with the same output folder, every rank
of a job that never made a process group) take turns: a rotation save holds `series_lock` (an
exclusive flock on the directory itself, no file of its own) from reading the next sequence number
until its pointer update and deletions are done, so numbers never repeat and rotation never deletes
a newer file than its own. Equal sequences (only from files made otherwise) are ordered by name.

Resuming does not trust the pointer blindly: `complete_checkpoints` reads every torchplace header
in the directory and orders the complete ones, so a save killed after its rename but before the
pointer update, or a file damaged later, still resolves to the newest whole one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import shutil
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointFormatError, TorchplaceWarning
from ..policy.resume import JOB_FILE
from .atomic import write_bytes
from .dcp_reader import is_dcp_dir
from .format import SIDE_FILE, cut_short, read_header

POINTER = "latest"
POINTER_FORMAT = "torchplace-latest/1"
MAX_POINTER_BYTES = 8 * 2**20  # a pointer naming 100,000 checkpoints is about 3 MiB
# the names transformers and accelerate read as a model's plain weights (save and convert write only those there)
HF_WEIGHT_NAMES = re.compile(r"(model|adapter_model)(-\d+-of-\d+)?\.safetensors|pytorch_model(-\d+-of-\d+)?\.bin")


def check_name(target: Path) -> None:
    """Refuse a checkpoint named `latest` (any case: some file systems ignore it): the pointer's name."""
    if target.name.casefold() == POINTER:
        raise CheckpointError(
            f"save({str(target)!r}) asked for a checkpoint named {target.name!r}; the name {POINTER!r} is reserved "
            f"for the pointer that keep_last= and latest=True write into the directory, which would overwrite the "
            f"checkpoint (at this save or a later one). Nothing was written. Fix: save under another name, e.g. "
            f"{str(target.with_name('step-000300.safetensors'))!r}.")


def _read_small(path: Path) -> bytes | None:
    """PATH's bytes if it is a regular file (not a link) of at most MAX_POINTER_BYTES, else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_POINTER_BYTES:
            return None
        return os.pread(fd, MAX_POINTER_BYTES + 1, 0)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_pointer(path: str | os.PathLike[str]) -> bool:
    """True when PATH is a `latest` pointer file written by rotation."""
    path = Path(path)
    if path.name != POINTER:
        return False
    data = _read_small(path)
    try:
        pointer = json.loads(data) if data is not None else None
    except ValueError:
        return False
    return isinstance(pointer, dict) and pointer.get("format") == POINTER_FORMAT


def _slot_problem(directory: Path) -> str | None:
    """Why DIRECTORY/latest must not be replaced by a pointer, or None when it may be: it is missing, a
    pointer, or a damaged pointer (a small text file). Anything else may be someone's data."""
    slot = directory / POINTER
    try:
        info = os.lstat(slot)
    except (FileNotFoundError, NotADirectoryError):  # no pointer; a missing directory: the write says so
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENAMETOOLONG):  # the directory's path, not the slot: the write says so
            return None
        return f"it cannot be examined ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link (a sharded checkpoint is one)"
    if stat.S_ISDIR(info.st_mode):
        return "it is a directory"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    data = _read_small(slot)
    if data is None:
        return f"it is a file of {info.st_size} bytes, larger than any pointer"
    if b"\0" in data:
        return f"it is a binary file of {len(data)} bytes (a checkpoint?)"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return f"it is a binary file of {len(data)} bytes (a checkpoint?)"
    return None


def check_pointer_slot(directory: Path) -> None:
    """Refuse to rotate in DIRECTORY when its `latest` holds something other than a pointer."""
    problem = _slot_problem(directory)
    if problem is not None:
        slot = directory / POINTER
        raise CheckpointError(
            f"{slot} is not a `latest` pointer ({problem}), and saving with keep_last= or latest=True would replace "
            f"it with one. Nothing was written. Fix: move or rename {slot} (the name {POINTER!r} is reserved for "
            "the pointer), or save into another directory.")


_held: set[int] = set()  # directory descriptors of series locks in this process, held or waited for
_held_guard = threading.Lock()  # taken around a fork too: no descriptor is opened or closed uncounted


def _drop_inherited_locks() -> None:
    """In a forked child: close the descriptors of the parent's series locks. flock belongs to the open file
    description, which fork shares: a DataLoader worker keeping its copy would hold the directory locked
    after the parent's save ended, and the parent's next rotation save would wait for the worker to exit.
    A descriptor counts from its open, before the flock wait: one forked during the wait is the parent's
    lock as soon as the parent gets it."""
    global _held_guard
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _held_guard = threading.Lock()


def _before_fork() -> None:
    _held_guard.acquire()


def _after_fork_in_parent() -> None:
    _held_guard.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_drop_inherited_locks)


def _open_counted(directory: Path) -> int:
    """DIRECTORY opened for its series lock and counted in _held in one step (a fork waits for both)."""
    with _held_guard:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
        _held.add(fd)
    return fd


def _close_counted(fd: int) -> None:
    with _held_guard:
        _held.discard(fd)
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def series_lock(directory: Path, active: bool = True) -> Iterator[None]:
    """Hold DIRECTORY's rotation series for one save (when ACTIVE): an exclusive flock on the directory,
    waited for while another process (or thread) holds it. Best effort: a directory that cannot be
    opened (the write then reports it) or a file system without flock is not locked."""
    fd = -1
    if active:
        try:  # not a directory, a symlink loop, a name too long, ...: the write names it (atomic.os_error)
            fd = _open_counted(directory)
        except OSError:
            active = False
    if active:
        try:
            _wait_for_lock(fd, directory)
        except BaseException as exc:
            _close_counted(fd)
            fd = -1
            if not isinstance(exc, OSError) or exc.errno not in (
                    errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP,
                    errno.EBADF):
                raise
    try:
        yield
    finally:
        if fd >= 0:
            _close_counted(fd)


LOCK_WARN_S = 30.0  # one save of another process rarely holds the series longer: say who is waited for
LOCK_TIMEOUT_S = 1800.0  # a holder frozen (SIGSTOP, a hung file system) must not stop this job for ever


def _wait_for_lock(fd: int, directory: Path) -> None:
    """An exclusive flock on FD (DIRECTORY), polled: a warning once another process has held it for
    LOCK_WARN_S, a CheckpointError after LOCK_TIMEOUT_S (a blocking flock would wait for ever)."""
    start, delay, warned = time.monotonic(), 0.001, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= LOCK_TIMEOUT_S:
            raise CheckpointError(
                f"{directory}: another process has been saving into this directory for {waited:.0f} s and still "
                "holds its checkpoint series (two jobs writing into one output directory, or a job that is frozen). "
                "Nothing was written. Fix: give each job its own directory, or stop the other job.")
        if not warned and waited >= LOCK_WARN_S:
            warned = True
            warnings.warn(f"{directory}: waiting for another process that is saving into this directory (for "
                          f"{waited:.0f} s so far; two jobs writing into one output directory?). The save goes on "
                          f"once it is done, or stops after {LOCK_TIMEOUT_S:.0f} s.", TorchplaceWarning, stacklevel=4)
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


MAX_SEQUENCE = 2**63 - 1  # a save a microsecond for 290,000 years; beyond it a header is crafted


def _sequence(meta: dict[str, Any]) -> int | None:
    """The header's sequence number, or None when it has none: a value that is not an int in
    [0, MAX_SEQUENCE] counts as none, so a planted file cannot push the next number past what
    JSON writers print (Python refuses ints of more than 4300 digits) and stop every later save."""
    value = meta.get("sequence")
    return value if type(value) is int and 0 <= value <= MAX_SEQUENCE else None


def next_sequence(directory: Path) -> int:
    """1 + the largest sequence number in DIRECTORY's complete rotation series (1 when none has one)."""
    try:
        found = [_order(Path(e.path), True) for e in os.scandir(directory)
                 if not e.name.startswith(".") and e.name != POINTER]
    except OSError:  # a missing or unreadable directory: the write itself reports it
        return 1
    return 1 + max((key[1] for key in found if key is not None and key[0]), default=0)


def _remove(path: Path) -> bool:
    """Delete a checkpoint file, or a sharded checkpoint (symlink plus the directory it names)."""
    try:
        if path.is_symlink():
            real = path.parent / os.readlink(path)
            path.unlink()
            if real.parent == path.parent and real.name.startswith("."):
                shutil.rmtree(real, ignore_errors=True)
        else:
            path.unlink()
        return True
    except FileNotFoundError:
        return False


def rotate(target: Path, keep_last: int | None) -> list[Path]:
    """Point `latest` at TARGET (already durable); delete the series' oldest beyond KEEP_LAST; return them."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint (or None to keep all).")
    directory = target.parent
    problem = _slot_problem(directory)  # checked before the save too; this catches one made meanwhile
    if problem is not None:
        raise CheckpointError(
            f"{target} was saved, but {directory / POINTER} is not a `latest` pointer ({problem}), so the pointer "
            f"was not updated and no old checkpoint was deleted. Fix: move or rename {directory / POINTER} (the "
            f"name {POINTER!r} is reserved for the pointer).")
    series = [p for p in complete_checkpoints(directory, rotation_only=True) if p.name != target.name]
    series = [target] + series  # newest first
    keep, drop = (series[:keep_last], series[keep_last:]) if keep_last is not None else (series, [])
    pointer = {"format": POINTER_FORMAT, "latest": target.name, "history": [p.name for p in reversed(keep)],
               "updated_unix": time.time()}
    write_bytes(directory / POINTER, (json.dumps(pointer, indent=1) + "\n").encode())
    return [p for p in drop if _remove(p)]


def check_format(directory: Path, complete: list[Path], newer: list[tuple[Path, CheckpointFormatError]]) -> None:
    """Refuse DIRECTORY when it holds a checkpoint a newer torchplace wrote (NEWER, as `complete_checkpoints`
    found them beside the COMPLETE ones): this one cannot read its sequence number, so resuming from the
    newest it can read might silently go back in time."""
    if not newer:
        return
    path, exc = newer[0]
    newest = f" ({complete[0].name} is the newest it can read)" if complete else ""
    raise CheckpointFormatError(
        f"{directory} holds {path.name}, which a newer torchplace wrote: {exc} This torchplace cannot tell "
        f"whether it is the newest checkpoint there{newest}, so it resumes from none. Fix: upgrade "
        f"torchplace (pip install -U torchplace), or load a checkpoint file by its name.")


def _order(path: Path, rotation_only: bool,
           newer: list[tuple[Path, CheckpointFormatError]] | None = None) -> tuple[bool, int, float] | None:
    """Where PATH's torchplace header places it (newer sorts higher): (has a sequence, sequence, creation
    time when it has none), or None when PATH is not a complete one (or, with ROTATION_ONLY, not one saved
    with keep_last / latest=True)."""
    probe = path / SIDE_FILE if is_dcp_dir(path) else path
    try:
        meta = read_header(probe).meta
    except CheckpointFormatError as exc:  # a newer torchplace's: NEWER collects it for `check_format`
        if newer is not None:
            newer.append((path, exc))
        return None
    except (CheckpointError, OSError):
        from . import _torchfile as torchfile  # torch.save files save() wrote under .pt/.pth/.tar/.ckpt/.bin names

        meta = torchfile.read_meta(path) if path.is_file() and torchfile.is_torch_name(path) else None
    if meta is None or (rotation_only and not meta.get("rotation")):
        return None
    sequence = _sequence(meta)
    if sequence is not None:
        return True, sequence, 0.0
    created = meta.get("created_unix")
    ok = isinstance(created, (int, float)) and not isinstance(created, bool) and math.isfinite(created)
    return False, 0, float(created) if ok else 0.0


def complete_checkpoints(directory: str | os.PathLike[str], *, rotation_only: bool = False,
                         newer: list[tuple[Path, CheckpointFormatError]] | None = None) -> list[Path]:
    """Torchplace checkpoints in DIRECTORY whose headers are whole, newest first (by sequence, then name);
    those a newer torchplace wrote are appended to NEWER, with the reason (see `check_format`).

    Only headers are read (sizes, structure, header checksum); tensor checksums are checked by
    `load`, which moves on to the next one if the newest turns out damaged.
    """
    directory = Path(directory)
    found = []
    for entry in os.scandir(directory):
        if entry.name.startswith(".") or entry.name == POINTER:
            continue
        path = Path(entry.path)
        order = _order(path, rotation_only, newer)
        if order is not None:
            found.append((order, entry.name, path))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [item[2] for item in found]


def cut_files(directory: Path) -> list[str]:
    """DIRECTORY's files that look like checkpoints cut short (a copy stopped by a full disk), which
    `complete_checkpoints` passes over because no order can be read from them: "NAME (SIZE bytes): why"."""
    from . import foreign

    found = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        why = cut_short(path) or ("it starts as a torch.save file but its end, the zip's directory, is missing"
                                  if foreign.is_cut_zip(path) else None)
        if why is not None:
            with contextlib.suppress(OSError):
                found.append(f"{entry.name} ({entry.stat().st_size} bytes): {why}")
    return found


def warn_cut(directory: Path, cut: list[str], chosen: str | None, stacklevel: int) -> None:
    """Say of each file in CUT (`cut_files`) that it was passed over, and what was CHOSEN instead."""
    instead = f"{chosen} instead" if chosen else "no complete checkpoint is left there"
    for what in cut:
        name = what.split(" (", 1)[0]
        warnings.warn(f"{directory}: passed over {what} (truncated?), so whether it is the newest cannot be "
                      f"read; {instead}. Fix: if {name} is the checkpoint to continue from, copy it again in full "
                      f"(compare its size with the original's); otherwise move it out of {directory}.",
                      TorchplaceWarning, stacklevel=stacklevel + 1)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint in DIRECTORY, or None."""
    found = complete_checkpoints(directory)
    return found[0] if found else None


def newest_name(checkpoint_dir: str | os.PathLike[str] | None) -> str | None:
    """The file name of the newest complete checkpoint in CHECKPOINT_DIR, or None (none, or no folder)."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        return None
    newer: list = []
    found = complete_checkpoints(checkpoint_dir, newer=newer)
    check_format(Path(checkpoint_dir), found, newer)  # a newer torchplace's checkpoint may be the newest: refuse
    warn_cut(Path(checkpoint_dir), cut_files(Path(checkpoint_dir)),
             f"picked {found[0].name}" if found else None, 2)
    return found[0].name if found else None


def mark_started(checkpoint_dir: str | os.PathLike[str], job: str) -> None:
    """Record in CHECKPOINT_DIR (made if missing) that the job JOB started there (rank 0 only)."""
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    write_bytes(Path(checkpoint_dir) / JOB_FILE, json.dumps({"run_id": job}).encode())
