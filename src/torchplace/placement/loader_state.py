"""Where a DeviceLoader stands in its epoch: saved with a checkpoint, resumed at the next batch.

A position is plain data (numbers and RNG state tensors): the batches handed out in the current
epoch, the RNG states the epoch's order was drawn from, the DistributedSampler's epoch and seed,
and, for torchdata's `StatefulDataLoader`, its own `state_dict()` as of the last batch handed out.
Resuming a plain DataLoader skips at the index level: for one epoch the loader iterates a copy of
itself whose batch sampler drops the first batches' indices (drawn under the epoch's saved RNG
states, so the order is the one the interrupted run had), and no skipped sample is loaded. A
`StatefulDataLoader` is given its own state back (`load_state_dict`).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CheckpointError
from ._inline import Epoch

MARK = "torchplace_loader"  # the key that marks a saved loader position (value: its format version)
VERSION = 1


def is_position(value: Any) -> bool:
    """VALUE is a saved loader position (one rank's, or every rank's under "per_rank")."""
    return isinstance(value, dict) and (value.get(MARK) == VERSION or isinstance(value.get("per_rank"), list))


def is_stateful(loader: Any) -> bool:
    """LOADER keeps its own position (torchdata's StatefulDataLoader): state_dict() and load_state_dict()."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _rng_now(loader: Any) -> dict[str, torch.Tensor]:
    """The RNG states an epoch's order and worker base seed are drawn from: torch's default CPU generator,
    the DataLoader's generator= and the sampler's own generator."""
    return {"torch": torch.get_rng_state(), **{name: gen.get_state() for name, gen in _generators(loader).items()}}


def _generators(loader: Any) -> dict[str, torch.Generator]:
    found = {}
    gen = getattr(loader, "generator", None)
    if isinstance(gen, torch.Generator):
        found["loader"] = gen
    gen = getattr(getattr(loader, "sampler", None), "generator", None)
    if isinstance(gen, torch.Generator) and gen is not found.get("loader"):
        found["sampler"] = gen
    return found


def _sampler_info(loader: Any) -> dict[str, Any]:
    sampler = getattr(loader, "sampler", None)
    info: dict[str, Any] = {"type": type(sampler).__name__ if sampler is not None else None}
    for name in ("epoch", "seed", "num_replicas", "rank"):
        value = getattr(sampler, name, None)
        if isinstance(value, int):
            info[name] = value
    return info


class Position:
    """One DeviceLoader's place: batches handed out in the current epoch and what its order came from."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.taken = 0  # batches handed out in the current epoch
        self.done = False  # the current epoch ran to its end (the next position is the next epoch's start)
        self.started = False
        self.rng: dict[str, torch.Tensor] = {}
        self.sampler: dict[str, Any] = {}
        self.pending: dict[str, Any] | None = None  # a saved position the next iter() resumes at
        self.skip = 0  # batches the pending position skips (after N -> M ranks)
        self.note = ""  # what the last restore did, for rt.resume's report
        self.snapshots: collections.deque[Any] = collections.deque()  # StatefulDataLoader: one per batch pulled
        self.stateful_now: Any = None

    def state_dict(self) -> dict[str, Any]:
        """This position as plain data, for a checkpoint."""
        length = _length(self.loader)
        between = self.done or not self.started  # after the epoch's end: the next one starts at its beginning
        state: dict[str, Any] = {MARK: VERSION, "taken": 0 if between else self.taken, "length": length,
                                 "sampler": dict(self.sampler), "rng": {} if between else dict(self.rng)}
        if is_stateful(self.loader):
            state["stateful"] = self.stateful_now if self.started and not between else None
        return state

    def load_state_dict(self, state: dict[str, Any], skip: int | None = None, note: str = "") -> None:
        """Resume at STATE on the next iter() (SKIP: the batches to skip, when the ranks changed)."""
        if not isinstance(state, dict) or state.get(MARK) != VERSION:
            raise CheckpointError(f"DeviceLoader.load_state_dict: {type(state).__name__} is not a loader position "
                                  f"saved by this torchplace (the {MARK!r} key is missing or of another version). "
                                  "Fix: pass the 'loader' entry of a checkpoint rt.save wrote.")
        _checked(state)
        _same_length(state, self.loader)
        self.pending = state
        self.skip = int(state["taken"]) if skip is None else skip
        self.note = note

    def open(self) -> Iterator[Any]:
        """The upstream iterator of a new epoch: at the pending position if there is one."""
        pending, self.pending = self.pending, None
        skip = self.skip if pending is not None else 0
        self.skip, self.started, self.done, self.taken = 0, True, False, skip
        self.snapshots.clear()
        self.stateful_now = None
        self.sampler = _sampler_info(self.loader)
        if pending is not None and skip:
            _check_sampler(pending.get("sampler") or {}, self.sampler)
            self.rng = dict(pending.get("rng") or {})
        else:
            self.rng = _rng_now(self.loader)
        if is_stateful(self.loader):
            if pending is not None and skip and pending.get("stateful") is not None and skip == pending["taken"]:
                self.loader.load_state_dict(pending["stateful"])
                self.stateful_now = pending["stateful"]
            elif skip:
                self.taken = 0
                self.note = (self.note + "; " if self.note else "") + (
                    "the StatefulDataLoader's own state cannot be resharded: its epoch starts again")
            return _Snapshots(iter(self.loader), self.loader, self.snapshots)
        if not skip:
            return iter(self.loader)
        index = _index_attr(self.loader)
        if index is None:  # an iterable without a sampler (an IterableDataset, a list): the batches are read
            it = iter(self.loader)
            for read in range(skip):  # bounded by the data: an edited count stops where the loader ends
                if next(it, _END) is _END:
                    raise CheckpointError(
                        f"The saved loader position is batch {skip} of an epoch, but this "
                        f"{type(self.loader).__name__} ended after {read} batch(es): the position belongs to other "
                        "data, or the file was edited. Fix: resume with the data it was saved with, or leave loader= "
                        "out of tp.load to start the epoch from its beginning.")
            self.note = (self.note + "; " if self.note else "") + (
                f"{type(self.loader).__name__} has no sampler to skip in, so the {skip} batch(es) before were read "
                "and dropped (torchdata's StatefulDataLoader with a stateful dataset skips without reading)")
            return it
        view = copy.copy(self.loader)  # this epoch only: the same loader, its index sampler starting SKIP batches in
        skipping = _Skipping(getattr(self.loader, index), skip)
        object.__setattr__(view, index, skipping)  # DataLoader refuses setting it after __init__; a copy is ours
        object.__setattr__(view, "_iterator", None)
        now = torch.get_rng_state()
        try:
            try:
                _set_rng(self.loader, self.rng)
            except RuntimeError as exc:  # a byte tensor of another length than a generator's state
                raise CheckpointError(f"The saved loader position is damaged: its RNG states do not fit ({exc}). "
                                      "Fix: load a checkpoint rt.save wrote, or leave loader= out to start the "
                                      "epoch from its beginning.") from None
            it = iter(view)
            skipping.prime()  # a single-process iterator draws the order at its first batch: draw it here
        finally:
            torch.set_rng_state(now)  # the training's own RNG stream is the checkpoint's, not the epoch start's
        return it

    def handed(self) -> None:
        self.taken += 1
        if self.snapshots:
            self.stateful_now = self.snapshots.popleft()


_END = object()  # what next() returns once a loader is exhausted


def _checked(state: dict[str, Any]) -> dict[str, Any]:
    """STATE when its fields are what `state_dict` writes; CheckpointError naming the first that is not
    (a file edited or cut: a negative or fractional count, RNG states that are not byte tensors)."""
    taken, length, rng, sampler = state.get("taken"), state.get("length"), state.get("rng"), state.get("sampler")
    problem = (
        "'taken' is not a whole number >= 0" if type(taken) is not int or taken < 0 else
        "'length' is not a whole number >= 0" if length is not None and (type(length) is not int or length < 0) else
        f"'taken' {taken} is more than the epoch's {length} batches" if length is not None and taken > length else
        "'sampler' is not a dict" if sampler is not None and not isinstance(sampler, dict) else
        "'rng' is not a dict of tensors" if rng is not None and not (isinstance(rng, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in rng.items())) else "")
    if problem:
        raise CheckpointError(f"The saved loader position is damaged: {problem} ({_shown(state)}). Fix: load a "
                              "checkpoint rt.save wrote, or leave loader= out to start the epoch from its beginning.")
    return state


def _shown(state: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}"[:60] for k, v in state.items() if k in ("taken", "length"))


def _same_length(state: dict[str, Any], loader: Any) -> None:
    """A position inside an epoch holds only for a loader of the same number of batches per rank (same dataset
    and batch size); after N -> M ranks `pick` converts it and the lengths differ by design."""
    saved, now = state.get("length"), _length(loader)
    replicas = (state.get("sampler") or {}).get("num_replicas"), _sampler_info(loader).get("num_replicas")
    if state.get("taken") and saved is not None and now is not None and saved != now and replicas[0] == replicas[1]:
        raise CheckpointError(
            f"The checkpoint's loader position is batch {state['taken']} of an epoch of {saved} batches, but the "
            f"loader given has {now} batches per epoch (another dataset, batch size or drop_last): that position "
            "is another sample's.\n"
            "Fix: resume with the dataset and batch size the checkpoint was saved with.\n"
            "Or: leave loader= out (and do not call rt.loader before rt.resume) to start the epoch from its "
            "beginning.")


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _index_attr(loader: Any) -> str | None:
    """The DataLoader attribute that yields its batches' indices (batch_sampler, or sampler without batching)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    return "batch_sampler" if loader.batch_sampler is not None else "sampler"


def _set_rng(loader: Any, saved: dict[str, torch.Tensor]) -> None:
    if "torch" in saved:
        torch.set_rng_state(saved["torch"])
    for name, gen in _generators(loader).items():
        if name in saved:
            gen.set_state(saved[name])


def _check_sampler(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A position inside a DistributedSampler's epoch holds only for that epoch and seed."""
    for key in ("epoch", "seed"):
        if key in saved and key in now and saved[key] != now[key]:
            raise CheckpointError(
                f"The checkpoint's loader position is inside {saved.get('type')} {key} {saved[key]}, but the loader "
                f"resumed now has {key} {now[key]}, so its batches would be another order's. Fix: call "
                f"sampler.set_epoch({saved.get('epoch')}) for the resumed epoch (the epoch saved with the "
                "checkpoint) and build the sampler with the same seed.")


class _Skipping:
    """An index sampler whose next iteration starts SKIP batches in (indices drawn and dropped, no data read)."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip
        self.last: _SkipIter | None = None
        self.batch_size = getattr(inner, "batch_size", None)
        self.drop_last = getattr(inner, "drop_last", False)
        self.sampler = getattr(inner, "sampler", inner)

    def __iter__(self) -> _SkipIter:
        it = self.last = _SkipIter(iter(self.inner), self.skip)
        return it

    def __len__(self) -> int:
        return max(0, len(self.inner) - self.skip)

    def prime(self) -> None:
        if self.last is not None:
            self.last.skip_now()


class _SkipIter(Iterator[Any]):
    def __init__(self, it: Iterator[Any], skip: int) -> None:
        self.it, self.left = it, skip

    def skip_now(self) -> None:
        while self.left:
            self.left -= 1
            if next(self.it, _END) is _END:
                self.left = 0

    def __next__(self) -> Any:
        self.skip_now()
        return next(self.it)


_END = object()


class _Snapshots(Iterator[Any]):
    """A StatefulDataLoader's iterator that records its state after each batch, for the batch handed out
    last (a worker thread may pull batches ahead of the loop)."""

    def __init__(self, it: Iterator[Any], loader: Any, out: collections.deque[Any]) -> None:
        self.it, self.loader, self.out = it, loader, out

    def __next__(self) -> Any:
        batch = next(self.it)
        self.out.append(self.loader.state_dict())
        return batch

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if callable(close):
            close()


class Tracked(Epoch):
    """An epoch of a DeviceLoader that counts the batches it hands out into its Position."""

    def __init__(self, inner: Iterator[Any], position: Position) -> None:
        self.inner, self.position = inner, position

    def __next__(self) -> Any:
        try:
            batch = next(self.inner)
        except StopIteration:
            self.position.done = True
            raise
        self.position.handed()
        return batch

    def running(self) -> bool:
        return self.inner.running() if isinstance(self.inner, Epoch) else True

    def close(self) -> None:
        if isinstance(self.inner, Epoch):
            self.inner.close()

    def supersede(self) -> None:
        if isinstance(self.inner, Epoch):
            self.inner.supersede()


def pick(saved: dict[str, Any], rank: int, world_size: int) -> tuple[dict[str, Any], int, str]:
    """This rank's (position, batches to skip, note) from a saved one (every rank's, or one rank's).

    A DistributedSampler deals rank r the positions r, r + N, r + 2N ... of one order, so N ranks that
    each took k batches of b consumed its first k * b * N positions; on M ranks that is k * N / M batches
    each, exact when M divides k * N (otherwise the rest of one batch per rank is seen again)."""
    ranks = saved.get("per_rank") if "per_rank" in saved else None
    state = ranks[rank] if ranks is not None and len(ranks) == world_size else (ranks[0] if ranks else saved)
    if not isinstance(state, dict) or state.get(MARK) != VERSION:
        raise CheckpointError(f"The saved loader position is damaged: rank {rank}'s entry is not a position of this "
                              "torchplace. Fix: load a checkpoint rt.save wrote, or leave out the loader to start "
                              "the epoch from its beginning.")
    _checked({**state, "rng": None})  # its RNG states are checked when given to the loader (a summary has no tensors)
    saved_world = len(ranks) if ranks is not None else int(saved.get("world_size") or world_size)
    taken = int(state["taken"])
    if saved_world == world_size or not taken:
        return state, taken, ""
    skip, rest = divmod(taken * saved_world, world_size)
    note = (f"loader position saved by {saved_world} rank(s) ({taken} batch(es) each) and this run has {world_size}: "
            f"each rank skips {skip} batch(es) of the epoch's order"
            + (f"; {rest} batch(es) of samples before the position are seen again ({taken} x {saved_world} is not "
               f"a multiple of {world_size})" if rest else " (exact)"))
    return state, skip, note
