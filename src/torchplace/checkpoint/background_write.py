"""The writer thread's part of one background save: wait for the saves before it, write at a lowered CPU
priority, and hand back the error without frames (the future keeps it; frames would keep the staging)."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import CheckpointError
from .stream import lower_priority


def written(fut: Any, before: threading.Event | None, write: Callable[[], None], nice: int) -> CheckpointError | None:
    """Run WRITE (after BEFORE is set) at NICE more than the caller's nice value; its CheckpointError
    (without frames) or None. FUT's writer_nice records the priority it ran at."""
    try:
        fut.writer_nice = lower_priority(nice)
        if before is not None:  # saves reach the disk (and the rotation series) in call order
            before.wait()
        write()
    except CheckpointError as exc:
        return without_frames(exc)
    except BaseException as exc:  # reported through the future, never lost in a thread
        error = CheckpointError(f"the background save of {fut.path} failed: {type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return without_frames(error)
    return None


def without_frames(error: CheckpointError) -> CheckpointError:
    """ERROR with its chain's tracebacks kept as text (a note, Python 3.11+) instead of frames.

    The future keeps its error; frames would keep what they reach (the write's closures, the staging
    buffers, the frame that caught the error and so the error again): a reference cycle that only a
    garbage collection frees, and one in a forked DataLoader worker frees the parent's pinned memory.
    """
    told = traceback.TracebackException.from_exception(error)
    lines = list(told.format())
    text = "".join(lines[:len(lines) - len(list(told.format_exception_only()))])  # the message is said already
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    if hasattr(error, "add_note"):
        error.add_note(f"torchplace: raised in the background writer thread:\n{text.rstrip()}")
    return error
