"""The progress bar of long commands: a rich bar on stderr when it is a terminal, nothing otherwise.

`progress_bar()` yields the callback that library calls take as `progress=` (see
torchplace.progress): on a terminal it draws one bar per phase (what, bar, percent or a pulse
while the total is unknown, elapsed and remaining time) and clears it when the work ends; into a
pipe or a file it yields None, so a script reading the output gets exactly what it got before.
The bar starts with the first report, so work that reports nothing draws nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..progress import ProgressFn


def shown() -> bool:
    """True when stderr is a terminal a bar can be redrawn on (not a pipe, a file or TERM=dumb).

    Decided without importing rich, so a command that ends early (a bad argument) pays nothing."""
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False
    return terminal and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")


@contextmanager
def progress_bar() -> Iterator[ProgressFn | None]:
    """The progress callback for the work in this block: a bar on a terminal, None elsewhere."""
    if not shown():
        yield None
        return
    bar = _Bar()
    try:
        yield bar
    finally:
        bar.stop()


class _Bar:
    """Draws what `progress(what, done, total)` reports; one task per phase."""

    def __init__(self) -> None:
        self.progress: Any = None
        self.task: Any = None
        self.what: str | None = None

    def __call__(self, what: str, done: int, total: int | None) -> None:
        if self.progress is None:
            self.progress = self._start()
        if what != self.what or self.task is None:
            if self.task is not None:
                self.progress.remove_task(self.task)
            self.task, self.what = self.progress.add_task(what, total=total, completed=done), what
            return
        if total is not None:
            self.progress.update(self.task, total=total, completed=done)
        else:
            self.progress.update(self.task, completed=done)

    @staticmethod
    def _start() -> Any:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            SpinnerColumn,
            TaskProgressColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(),
                   TaskProgressColumn(), TimeElapsedColumn(), TimeRemainingColumn())
        progress = Progress(*columns, console=Console(stderr=True, markup=False, emoji=False, highlight=False),
                            transient=True, refresh_per_second=8)
        progress.start()
        return progress

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
