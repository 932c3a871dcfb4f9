"""The consumer's side of a DeviceLoader epoch: taking a staged batch, and staging on the caller's thread.

`InlineIter` stages on the loop's thread, for batches packed in the DataLoader's workers; the loop
takes every batch through `Stager.hand_out`, whichever thread staged it.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from . import _slots
from ._stage import Staged, Stager


class Epoch(Iterator[Any]):
    """One epoch of a DeviceLoader, which a newer epoch over the same one-iterator DataLoader
    (persistent_workers=True) may end (`supersede`): touched again, it says so."""

    superseded = False

    def close(self) -> None:
        raise NotImplementedError

    def running(self) -> bool:
        raise NotImplementedError

    def supersede(self) -> None:
        """End this epoch now, if it has not ended, and make its next batch say why."""
        if self.running():
            self.superseded = True
            self.close()

    def ended(self) -> Exception:
        """What __next__ raises once the epoch is over: StopIteration, or why it was ended early."""
        return RuntimeError(SUPERSEDED) if self.superseded else StopIteration()


SUPERSEDED = ("DeviceLoader: this epoch was ended by a newer epoch over the same DataLoader (persistent_workers=True "
              "gives a DataLoader one iterator, which each iter() restarts, so two epochs at once would split its "
              "batches between them). Fix: finish or leave one loop before starting the other, or give each loop "
              "its own DataLoader.")


class InlineIter(Epoch):
    """One epoch of a DeviceLoader staged on the caller's thread, for batches packed in the
    DataLoader's workers: staging one is a copy and a rebuild, and handing it over from a worker
    thread cost more (H200, 64 tensors a batch: 189 µs a batch through the thread, 140-150 µs
    here, for a 78 µs copy). The copies still run on the side stream, PREFETCH - 1 batches ahead
    of the one handed out. Batch i is staged once the device has reached the point where the loop
    took batch i - PREFETCH - 1: one batch more than the worker thread keeps (it waits for
    i - PREFETCH), as waiting here stops the loop; so the loop waits for the device no sooner than
    with the worker, and device memory stays bounded."""

    def __init__(self, it: Iterator[Any], owned: bool, stager: Stager, prefetch: int, first: Any) -> None:
        self._it, self._owned, self._stage, self._prefetch = it, owned, stager, prefetch
        self._staged: collections.deque[Staged] = collections.deque()  # staged, not yet handed out
        self._taken: collections.deque[Any] = collections.deque()  # tokens of batches handed out, oldest first
        self._source_read: Any = None
        self._ended = self._done = False
        stager.owner = self._owner = object()  # the slots this epoch holds are settled by close()
        try:
            self._add(first)
        except BaseException:  # iter() raises: the upstream (a DataLoader's workers) is closed now, not at GC
            self.close()
            raise

    def _add(self, batch: Any) -> None:
        with self._stage.on_side():
            staged = self._stage(batch)
        self._source_read = staged.source_read
        self._staged.append(staged)

    def _fill(self) -> None:
        while not self._ended and len(self._staged) < self._prefetch:
            if self._source_read is not None:  # the upstream may overwrite its own pinned buffers in next()
                self._stage.source_done(self._source_read)
                self._source_read = None
            try:
                batch = next(self._it)
            except StopIteration:
                self._ended = True
                return
            if len(self._taken) >= self._prefetch:  # batch i waits for the device to reach batch i - PREFETCH - 1
                self._stage.handed(self._taken.popleft())
            self._add(batch)
            del batch

    def __next__(self) -> Any:
        if self._done:
            raise self.ended()
        try:
            self._fill()
        except BaseException:
            self.close()
            raise
        if not self._staged:
            self.close()
            raise StopIteration
        item = self._staged.popleft()
        self._taken.append(self._stage.hand_out(item))
        return item.batch

    def running(self) -> bool:
        return not self._done

    def close(self) -> None:
        """Drop the batches staged ahead, let the upstream clean up, and let this epoch's slots go."""
        if self._done:
            return
        self._done = True
        self._staged.clear()
        if self._owned:
            close_upstream(self._it)
        _slots.settle(self._owner)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def close_upstream(it: Any) -> None:
    """Run a generator's cleanup now (its `finally` blocks) rather than at garbage collection."""
    close = getattr(it, "close", None)
    if callable(close):
        close()
