"""Progress of long library work, told to a callback the caller gives; nothing is displayed here.

Long calls (`checkpoint.convert`, `checkpoint.inspect(verify=True)`, the benchmarks) take
`progress=`, a callable `progress(what, done, total)`: WHAT names the current phase ("writing
model.tp"), DONE counts its finished units (chunks of the data region, steps, rounds) and TOTAL
their number, or None while it is not known (a `torch.load` gives no count). A new phase starts
at done=0. It is called on the caller's thread, between pieces of work, never concurrently.

The `torchplace` command passes a progress bar when stderr is a terminal (cli/progress.py);
library code never imports a display.

Inside the library, `reporting(progress)` makes the callback current for everything below it
(a context variable, so the layers between need no extra argument); `begin(what, total)` starts a
phase and `advance(n)` counts work done. Both do nothing when no callback is current, as inside
`silenced()`.

    >>> seen = []
    >>> with reporting(lambda what, done, total: seen.append((what, done, total))):
    ...     begin("counting", 2)
    ...     advance()
    ...     advance()
    >>> seen
    [('counting', 0, 2), ('counting', 1, 2), ('counting', 2, 2)]
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: progress(what, done, total): see the module docstring
ProgressFn = Callable[[str, int, "int | None"], None]


class _Phase:
    __slots__ = ("fn", "what", "done", "total")

    def __init__(self, fn: ProgressFn) -> None:
        self.fn, self.what, self.done, self.total = fn, "working", 0, None

    def tell(self) -> None:
        self.fn(self.what, self.done, self.total)


_current: contextvars.ContextVar[_Phase | None] = contextvars.ContextVar("torchplace_progress", default=None)


@contextmanager
def reporting(progress: ProgressFn | None) -> Iterator[None]:
    """Report the work inside this block to PROGRESS (None: keep the callback already current)."""
    if progress is None:
        yield
        return
    token = _current.set(_Phase(progress))
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def silenced() -> Iterator[None]:
    """Report nothing from inside this block (a benchmark timing a call that reports its own phases)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def begin(what: str, total: int | None = None) -> None:
    """Start the phase WHAT of TOTAL units (None: not known yet)."""
    phase = _current.get()
    if phase is not None:
        phase.what, phase.done, phase.total = what, 0, total
        phase.tell()


def advance(n: int = 1, *, total: int | None = None) -> None:
    """N more units of the current phase are done; TOTAL, when given, sets how many there are."""
    phase = _current.get()
    if phase is not None:
        if total is not None:
            phase.total = total
        phase.done += n
        phase.tell()


def active() -> bool:
    """True when a callback is listening (so a caller can skip work done only to report)."""
    return _current.get() is not None
