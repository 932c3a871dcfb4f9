"""Open untrusted input files within fixed bounds: one helper per concern.

Checkpoints and snapshots come from other machines and other people. Whatever they hold, reading
them must neither hang nor take more memory than the file is worth. So every reader here:

- opens without blocking and refuses anything that is not a regular file (a FIFO, /dev/zero, a
  socket, a directory) at once, from the open descriptor (no window between check and open);
- reads small files (JSON) only up to a size limit it states;
- parses JSON with a nesting limit (Python's parser raises RecursionError on deep input, and
  every recursive walk after it would too).

`build` turns a JSON object into a typed record, checking every field against its annotation.
Each file helper takes the error class to raise (CheckpointError, SnapshotError), so every message
names the file, says what is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import stat
import types
import typing
from typing import Any, TypeVar

from .errors import TorchplaceError

T = TypeVar("T")
MAX_JSON_DEPTH = 128  # nesting levels of JSON any reader accepts (torchplace writes fewer than 40)

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """'a FIFO (named pipe)', 'a directory', ... for a stat mode that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def missing(path: str | os.PathLike[str]) -> str:
    """'PATH does not exist', with what does: a quoted '~' the shell did not expand, the names in its
    folder that are close to it, or the nearest folder above it that exists."""
    import difflib

    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    said = f"{_shown(text)} does not exist"
    if os.path.islink(text):  # the name exists: what it points to does not
        return f"{text} is a symbolic link to {os.readlink(text)}, which does not exist."
    if text.startswith("~") and os.path.expanduser(text) != text:
        expanded = os.path.expanduser(text)
        there = "exists" if os.path.exists(expanded) else "does not exist either"
        return (f"{said} ('~' is a shell's shorthand, expanded only when unquoted, and Python does not expand "
                f"it: {expanded} {there}).")
    folder = os.path.dirname(os.path.abspath(text))
    try:
        with os.scandir(folder) as entries:  # a dataset folder may hold millions: look at the first MISSING_SCAN
            names = sorted(e.name for e in itertools.islice(entries, MISSING_SCAN + 1))
    except OSError:
        above = folder
        while not os.path.isdir(above) and os.path.dirname(above) != above:
            above = os.path.dirname(above)
        return f"{said}: its folder {folder} does not exist (the nearest that does is {above})."
    more = len(names) > MISSING_SCAN
    names = names[:MISSING_SCAN]
    close = difflib.get_close_matches(os.path.basename(text), names, n=3, cutoff=0.6)
    some = f" (of the first {MISSING_SCAN} names read)" if more else ""
    if close:
        return f"{said}. Close names in {folder}{some}: {', '.join(map(_shown, close))}."
    count = f"more than {MISSING_SCAN}" if more else str(len(names))
    shown = ", ".join(names[:8]) + (f", ... ({count} in all)" if len(names) > 8 else "")
    return f"{said}. {folder} holds: {shown or 'nothing'}."


def _shown(name: str) -> str:
    """NAME as printed, quoted where it holds what a reader cannot see (' good.pt', a tab, a newline)."""
    plain = name.isprintable() and all(part == part.strip() for part in name.split(os.sep))
    return name if plain else repr(name)


MISSING_SCAN = 10_000  # names of a folder compared with a missing path: enough for any checkpoint folder


def _uid() -> str:
    geteuid = getattr(os, "geteuid", None)
    return f" (uid {geteuid()})" if geteuid else ""


def open_regular(path: str | os.PathLike[str], error: type[TorchplaceError], fix: str) -> tuple[int, int]:
    """(fd, size) of the regular file PATH, opened read-only; ERROR (ending with FIX) for anything else.

    Opened with O_NONBLOCK, so a FIFO with no writer does not block the open; the descriptor is
    checked with fstat, so what is read is what was checked.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{missing(path)} {fix}") from None
    except PermissionError as exc:
        raise error(f"cannot open {path}: {exc.strerror or exc}: this user{_uid()} may not read it. Fix: "
                    f"check its permissions (ls -l {shlex.quote(str(path))}), or read it as a user who may.") from None
    except OSError as exc:
        raise error(f"cannot open {path}: {exc.strerror or exc}. {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path} is {kind_of(info.st_mode)}, not a regular file, so it is not read. {fix}")
        if flags & getattr(os, "O_NONBLOCK", 0):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info.st_size


def read_limited(path: str | os.PathLike[str], limit: int, error: type[TorchplaceError], fix: str) -> bytes:
    """The bytes of the regular file PATH, or ERROR when it is larger than LIMIT bytes."""
    fd, size = open_regular(path, error, fix)
    try:
        if size > limit:
            raise error(f"{path} is {size} bytes; at most {limit} are read. {fix}")
        chunks, total = [], 0
        while total <= limit:  # the size may change while reading: never read past the limit
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}. {fix}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise error(f"{path} grew past {limit} bytes while being read. {fix}")
    return b"".join(chunks)


def json_depth(value: Any) -> int:
    """How deeply VALUE's lists and dicts nest (0 for a scalar), without recursion: one level at a time,
    each a single comprehension over the containers of the level above (a few times faster than a
    walk node by node: a model's header is thousands of nodes, and every load checks it)."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level:
        depth += 1
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
    return depth


def loads(text: str | bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads that raises ValueError (never RecursionError) and refuses nesting deeper than MAX_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than Python can parse (the limit is {max_depth} levels)") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    depth = json_depth(value)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep (the limit is {max_depth})")
    return value


def build(cls: type[T], data: Any, where: str) -> T:
    """An instance of the dataclass CLS from the JSON object DATA, every field checked against its
    annotation (int, str, float, None, lists, dicts, nested dataclasses built the same way); unknown
    keys are ignored. ValueError naming WHERE and the field for anything else."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} is a {type(data).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where} has no {f.name!r}")
            continue
        values[f.name] = _convert(data[f.name], hints[f.name], f"{where}.{f.name}")
    return cls(**values)


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                return _convert(value, arg, where)
            except ValueError as exc:
                errors.append(exc)
        raise next((e for arg, e in zip(args, errors) if arg is not type(None) and value is not None), errors[-1])
    if hint is type(None):
        if value is not None:
            raise ValueError(f"{where} is {value!r:.60}, not null")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where} is a {type(value).__name__}, not a list")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} is a {type(value).__name__}, not an object")
        return {k: _convert(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    ok = {int: lambda v: type(v) is int, float: lambda v: type(v) in (int, float),
          bool: lambda v: type(v) is bool, str: lambda v: type(v) is str}.get(hint)
    if ok is None or not ok(value):
        raise ValueError(f"{where} is {value!r:.60}, not a {getattr(hint, '__name__', hint)}")
    if type(value) is int and not -MAX_READING <= value <= MAX_READING:
        raise ValueError(f"{where} is a number of {len(str(abs(value)))} digits, more than any reading holds "
                         f"(at most {MAX_READING}, 64 bits)")
    return value


MAX_READING = 2**64 - 1  # NVML and the kernel report 64-bit counters: a larger number in a snapshot is crafted
