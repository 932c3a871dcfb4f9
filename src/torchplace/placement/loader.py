"""`DeviceLoader`: batches arrive already on the device, their copies hidden behind compute.

Per iteration, one worker thread pulls from the wrapped loader, pins host memory (reusing the
DataLoader's pinning where it is on), copies small tensors together into one device buffer,
all on one side stream per loader (`_stage.Stager`). When the consumer takes a batch its
stream waits on the batch's event; `record_stream` keeps the batch's memory from being reused
until the consumer's work on it is done. The worker stays at most `prefetch` batches ahead of
the step the device is running (not the step the host is enqueueing), so device memory stays
bounded however far the host runs ahead. Batches packed in the DataLoader's workers
(`packed_collate`) are staged on the caller's thread instead (`_inline.InlineIter`): one copy and a
rebuild each, cheaper than handing them between threads. On devices without streams (cpu, meta, mps) it is a
plain pass-through through `to_device`, unless asked to run the same worker in the background
(to overlap a slow loader, or a transform, with compute).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from ..hardware.accelerator import device_module, has_streams, say_once
from ..policy.devices import DeviceSpec
from ..shared.tree import map_tensors
from . import _fork, _slots  # noqa: F401  (_fork: its at-fork hooks)
from ._inline import Epoch, InlineIter, close_upstream
from ._stage import Staged, Stager
from .collate import PackedBatch
from .loader_state import Position, Tracked
from .transfer import target_device, to_device

T = TypeVar("T")
_HOST_LIKE = ("cpu", "meta", "mps")  # nothing to overlap (host memory, no data, unified memory)
_JOIN_S = 2.0  # how long close() waits for the worker thread
# DataLoader(persistent_workers=True) -> its DeviceLoader epoch still open: such a DataLoader has one
# iterator, which iter() resets, so a new epoch first ends the one before (its worker thread included)
_epochs: weakref.WeakKeyDictionary[Any, weakref.ReferenceType] = weakref.WeakKeyDictionary()

class DeviceLoader(Generic[T]):
    """Wrap a DataLoader (or any iterable of batches) so that its batches arrive on DEVICE.

    The copy of the next batches overlaps the current step: on devices with streams (cuda, xpu)
    a worker thread copies on a side stream from pinned memory, at most `prefetch` batches ahead
    of the step the device is running; elsewhere batches are moved in the loop. Small tensors of a
    batch are packed into one buffer so that one copy moves them all.

    Args:
        loader: a DataLoader or any iterable of batches (any nesting `to_device` accepts).
        device: any `torchplace.device` spec (default "auto").
        prefetch: how many batches may be copied ahead (>= 1; default 2).
        transform: `transform(batch)` runs on the device, on the side stream, after the copy (see
            `image_transform`).
        pack: False keeps one copy per tensor instead of packing small tensors together.
        background: use the worker thread; by default on devices with streams and not elsewhere,
            except for batches packed by `packed_collate`: staging one is a single copy, done on
            your thread (still on the side stream, `prefetch` ahead) as handing it over costs more.

    Iterating yields the loader's batches on DEVICE; `len()` and every attribute the wrapper does not
    have itself (`sampler`, `dataset`, `batch_size`, ...) are the wrapped loader's. A DataLoader with
    persistent_workers has one iterator: a new epoch over it ends the one before, whose next batch says so.

    Raises:
        DeviceError: the device does not exist here.
        TypeError: `loader` is not iterable, or `transform` is not callable.
        ValueError: `prefetch` is not an int >= 1.

    Example:
        ```python
        import torch
        import torchplace as tp
        from torch.utils.data import DataLoader, TensorDataset

        data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
        for x, y in tp.DeviceLoader(DataLoader(data, batch_size=16), "cpu", prefetch=2):
            print(x.device, x.shape)
        ```
    """

    def __init__(self, loader: Iterable[T], device: DeviceSpec = "auto", *, prefetch: int = 2,
                 transform: Callable[[Any], Any] | None = None, pack: bool = True,
                 background: bool | None = None) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"DeviceLoader(prefetch={prefetch!r}): prefetch is the number of batches copied "
                             "ahead and must be an int >= 1 (2 hides a copy behind one step of compute).")
        if not (hasattr(type(loader), "__iter__") or hasattr(type(loader), "__getitem__")):
            raise TypeError(f"DeviceLoader(loader={type(loader).__name__}): the loader must be iterable (a DataLoader "
                            "or any iterable of batches). Fix: DeviceLoader(DataLoader(dataset, batch_size=...), "
                            "device).")
        if transform is not None and not callable(transform):
            raise TypeError(f"DeviceLoader(transform={type(transform).__name__}): transform must be a function of "
                            "the batch, run on the device after each copy (e.g. image_transform(mean, std)), or None.")
        self.loader = loader
        self.device = target_device(device)
        self.prefetch = prefetch
        self.transform = transform
        self.pack = pack
        self.background = background
        self._stream: Any = None
        self._position = Position(loader)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch (plain data): saved with a checkpoint, `load_state_dict`
        resumes at the next batch without loading the ones before (torchplace.placement.loader_state)."""
        return self._position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next epoch (iter()) at the saved position STATE instead of its beginning."""
        self._position.load_state_dict(state)

    @property
    def stream(self) -> Any:
        """The side stream the copies run on (made once, at the first iteration; None on cpu)."""
        return self._stream

    def __getattr__(self, name: str) -> Any:
        """The wrapped loader's attribute (`sampler.set_epoch`, `dataset`, `batch_size`, ...), so that code
        written for the DataLoader keeps working on the wrapper made where the loader is made."""
        if name.startswith("__") or name == "loader":  # copy/pickle probes; `loader` not yet set
            raise AttributeError(name)
        try:
            return getattr(self.loader, name)
        except AttributeError:
            raise AttributeError(f"neither DeviceLoader nor the {type(self.loader).__name__} it wraps has an "
                                 f"attribute {name!r}") from None

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"DeviceLoader has no len(): the {type(self.loader).__name__} it wraps has none. "
                            "Fix: wrap a sized loader, or count the batches while iterating.") from None

    def __iter__(self) -> Iterator[T]:
        _fit_slots(self.loader, self.prefetch)
        one_iterator = bool(getattr(self.loader, "persistent_workers", False))
        if one_iterator:
            old = _epochs.pop(self.loader, None)
            old = old() if old is not None else None
            if old is not None:
                old.supersede()
        epoch = Tracked(self._epoch(), self._position)
        if one_iterator:
            _epochs[self.loader] = weakref.ref(epoch)
        return epoch

    def _epoch(self) -> Iterator[T]:
        it = self._position.open()  # iter(self.loader), at a saved position when one is pending
        owned = it is not self.loader  # a fresh iterator nobody else holds: ours to close early
        kind = self.device.type
        mod = device_module(kind)
        streams = has_streams(kind) and mod.is_available()
        if not streams and kind not in _HOST_LIKE:
            say_once(kind, "streams", f"{kind} has no streams in this torch (its device module has no Stream and "
                     "Event), so DeviceLoader copies each batch when the loop asks for it, and the copy does not "
                     "overlap compute.")
        if not (streams if self.background is None else self.background):
            return _SyncIter(it, owned, self.device, self.transform)
        if not streams:
            return _BackgroundIter(it, owned, Stager(self.device, None, None, None, self.transform, self.pack),
                                   self.prefetch)
        if self._stream is None:
            self._stream = mod.Stream(device=self.device)
        stager = Stager(self.device, mod, self._stream, mod.current_stream(self.device), self.transform, self.pack)
        if self.background:
            return _BackgroundIter(it, owned, stager, self.prefetch)
        try:  # the first batch says which way: packed in the workers, or not
            first = next(it)
        except StopIteration:
            return iter(())  # an empty epoch
        except BaseException:
            if owned:
                close_upstream(it)
            raise
        if type(first) is PackedBatch:
            return InlineIter(it, owned, stager, self.prefetch, first)
        return _BackgroundIter(it, owned, stager, self.prefetch, first)

    def __repr__(self) -> str:
        return f"DeviceLoader({type(self.loader).__name__}, device='{self.device}', prefetch={self.prefetch})"


class _SyncIter(Epoch):
    """The loader without a worker: `to_device` then the transform, on the consumer's thread."""

    def __init__(self, it: Iterator[Any], owned: bool, device: torch.device,
                 transform: Callable[[Any], Any] | None) -> None:
        self._it: Iterator[Any] | None = it
        self._owned = owned
        self._device = device
        self._transform = transform

    def __next__(self) -> Any:
        if self._it is None:
            raise self.ended()
        try:
            batch = next(self._it)
        except BaseException:
            self.close()
            raise
        batch = to_device(batch, self._device)
        return self._transform(batch) if self._transform else batch

    def running(self) -> bool:
        return self._it is not None

    def close(self) -> None:
        it, self._it = self._it, None
        if self._owned:
            close_upstream(it)

    def __del__(self) -> None:
        self.close()


class _Failure(NamedTuple):
    error: BaseException


_END = object()
_NONE = object()  # no batch pulled ahead


class _BackgroundIter(Epoch):
    """One epoch of a DeviceLoader whose batches a worker thread prepares (`_produce`)."""

    def __init__(self, it: Iterator[Any], owned: bool, stager: Stager, prefetch: int, first: Any = _NONE) -> None:
        self._stage = stager
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # worker -> consumer: staged batches
        self._handed: queue.SimpleQueue = queue.SimpleQueue()  # consumer -> worker: one token per batch taken
        self._stop = threading.Event()
        self._done = False
        # the thread gets the shared state, never `self`, so dropping the iterator stops it
        shared = (it, owned, stager, prefetch, self._queue, self._handed, self._stop, first)
        self._thread = threading.Thread(target=_produce, args=shared, name="torchplace-DeviceLoader", daemon=True)
        self._thread.start()

    def __next__(self) -> Any:
        """Hand out the next batch: the consumer's stream waits for its copy, the worker learns of it."""
        if self._done:
            raise self.ended()
        item = self._queue.get()
        if type(item) is not Staged:
            self.close()
            if item is _END:
                raise StopIteration
            raise item.error
        self._handed.put(self._stage.hand_out(item))
        return item.batch

    def running(self) -> bool:
        return not self._done

    def close(self) -> None:
        """Stop the worker, drop the batches copied ahead, and let the upstream clean up."""
        if self._done:
            return
        self._done = True
        self._stop.set()
        self._handed.put(None)  # wake a worker waiting for the consumer
        self._drain()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
            self._drain()  # a batch the worker finished while stopping

    def supersede(self) -> None:
        super().supersede()
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S * 5)  # out of the DataLoader's iterator before the new epoch restarts it

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: threading may be gone already
            pass


def _produce(it: Iterator[Any], owned: bool, stage: Stager, prefetch: int, out: queue.SimpleQueue,
             handed: queue.SimpleQueue, stop: threading.Event, first: Any) -> None:
    """Worker loop: wait until fewer than PREFETCH batches are ahead of the device, pull a batch,
    stage it, hand it over; end with _END or a failure.

    "Ahead of the device": batch i is staged only once the device has reached the point where
    the consumer took batch i - PREFETCH, so however far the host runs ahead, at most PREFETCH
    batches exist beyond the one the device is working on.
    """
    try:
        with stage.on_worker():
            source_read = None
            ahead = 0
            while True:
                while ahead >= prefetch and not stop.is_set():
                    try:
                        token = handed.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    stage.handed(token)
                    ahead -= 1
                if stop.is_set():
                    return
                if source_read is not None:  # the upstream may overwrite its own pinned buffers in next()
                    stage.source_done(source_read)
                try:
                    batch, first = (next(it), _NONE) if first is _NONE else (first, _NONE)
                except StopIteration:
                    _slots.settle()  # this thread's copies, before the end is told: the next epoch finds its slots free
                    out.put(_END)
                    return
                staged = stage(batch)
                del batch
                source_read = staged.source_read
                if stop.is_set():
                    return
                out.put(staged)
                del staged
                ahead += 1
    except BaseException as exc:  # handed to the consumer, raised there
        out.put(_Failure(exc))
    finally:
        if stop.is_set() and owned:
            close_upstream(it)
        del it
        _slots.settle()  # stopped early or failed: let the slots go all the same (nothing held: no-op)


def _fit_slots(loader: Any, prefetch: int) -> None:
    """Give a packed_collate's workers enough slots for the batches in flight: the DataLoader's
    prefetch_factor per worker, this loader's PREFETCH, the batch being staged and one more, and
    a wait for a free slot shorter than the DataLoader's timeout (set before iter() starts the
    workers; workers already running keep theirs)."""
    from .collate import PackedCollate

    collate = getattr(loader, "collate_fn", None)
    if type(collate) is not PackedCollate:
        return
    if hasattr(loader, "batch_sampler"):  # a DataLoader collates samples only with a batch sampler
        collate.batched = loader.batch_sampler is not None
    if collate.auto_slots and collate.slots:
        depth = getattr(loader, "prefetch_factor", None) or 2
        collate.slots = max(_slots.SLOTS, depth + prefetch + 2)
    timeout = getattr(loader, "timeout", 0) or 0
    if timeout > 0:  # a worker waiting for a slot must give up well before the DataLoader gives up on it
        collate.wait_s = min(collate.wait_s, timeout / 4)


def image_transform(mean: Sequence[float] | None = None, std: Sequence[float] | None = None, *,
                    dtype: torch.dtype = torch.float32, channels_last: bool = False) -> Callable[[Any], Any]:
    """A device-side transform for DeviceLoader: uint8 images to DTYPE, normalized, optionally NHWC.

    Every uint8 tensor in the batch (channels at dim -3) becomes DTYPE scaled to [0, 1], then
    (x - mean) / std per channel, then channels_last if 4-D. Other tensors are left as they are.
    """
    if (mean is None) != (std is None):
        raise ValueError("image_transform: give both mean and std (per-channel values in [0, 1] units), or neither.")
    if mean is not None and std is not None and len(mean) != len(std):
        raise ValueError(f"image_transform: mean has {len(mean)} values and std {len(std)}; give one per channel.")
    consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def image(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.uint8:
            return t
        fmt = torch.channels_last if channels_last and t.dim() == 4 else torch.preserve_format
        x = t.to(dtype=dtype, memory_format=fmt).div_(255)
        if mean is None or std is None:
            return x
        if t.dim() < 3 or t.shape[-3] != len(mean):
            raise ValueError(f"image_transform: a uint8 tensor of shape {tuple(t.shape)} has "
                             f"{t.shape[-3] if t.dim() >= 3 else 'no'} channels at dim -3, but mean and std "
                             f"have {len(mean)} values. Fix: give one value per channel, or keep non-image "
                             "uint8 data in another dtype.")
        if t.device not in consts:
            consts[t.device] = (torch.tensor(mean, dtype=dtype, device=t.device).view(-1, 1, 1),
                                torch.tensor(std, dtype=dtype, device=t.device).view(-1, 1, 1))
        m, s = consts[t.device]
        return x.sub_(m).div_(s)

    return lambda batch: map_tensors(batch, image)
