"""Slots of shared memory that DataLoader workers pack batches into, pinned once in the training process.

Without them, each packed batch is a fresh block of shared memory (a file, a mapping, page
faults in both processes), and the DataLoader's pin-memory thread copies it into pinned memory:
a memcpy of the whole batch plus the pinned allocator's work, on the training process's CPU.

With them, each worker owns a few slots (`WorkerRing`), blocks of shared memory it made and
reuses. A batch goes to the training process as (slot, size, layout): the slot's memory is sent
once, with the first batch that uses it, and from then on only its number. The training process
maps each slot once (`HostRing`) and page-locks it once (`cudaHostRegister`), so the pin-memory
step has nothing to copy and the copy to the GPU reads the worker's bytes where they are.

Who may write a slot: a shared flag per slot (`flags`, made by the worker, mapped by the
training process) says busy (1) or free (0). The worker sets it busy when it packs into the
slot; the training process sets it free when the last view of the batch's host buffer is gone
(the buffer is a `torch.frombuffer` tensor over the slot, whose holder frees the slot when it is
collected) and, for copies to a device, only once that copy has completed (`hold_until`).

A worker with no free slot waits up to `WAIT_S`, then packs into a fresh buffer and says so
(once, in the training process); it does not wait again until a slot is free again, so a user
who keeps every batch (`list(loader)`) costs one wait, not one per batch. Worker restarts and
persistent workers need nothing: rings are named per worker process, and a worker's new ring
replaces its predecessor's in the training process (whose memory lives on while batches hold it).
"""

from __future__ import annotations

import collections
import ctypes
import os
import secrets
import threading
import time
import weakref
from typing import Any, NamedTuple

import torch

from ..errors import PackingError

SLOTS = 6  # per worker: DataLoader's default prefetch_factor (2) + DeviceLoader's prefetch (2) + 2
WAIT_S = 1.0  # how long a worker waits for a free slot before it packs into a fresh buffer
_GRAIN = 64 << 10  # slot sizes are multiples of this (page-aligned for cudaHostRegister)
_HOLD_MAX = 64  # copies in flight kept by `hold_until` before the oldest is waited for
_FREE, _BUSY = 0, 1


class SlotRef(NamedTuple):
    """What a worker sends for a batch in a slot (STORAGE and FLAGS only when the receiver lacks them)."""

    ring: str
    owner: str  # the packed_collate it belongs to: one worker's new ring replaces its old one
    worker: int
    slot: int
    version: int  # grows when the slot is made larger
    nbytes: int
    storage: Any  # the slot's shared memory: sent with the first batch of each version
    flags: Any  # the ring's flags: sent with the ring's first batch


# -- the worker's side ---------------------------------------------------------------------------

class WorkerRing:
    """The slots of one worker process."""

    def __init__(self, owner: str, worker: int, slots: int) -> None:
        self.id = f"{os.getpid()}.{secrets.token_hex(6)}"
        self.owner, self.worker, self.pid = owner, worker, os.getpid()
        self.flags = torch.zeros(slots, dtype=torch.int32).share_memory_()
        self._flags = (ctypes.c_int32 * slots).from_address(self.flags.data_ptr())
        self.storages: list[Any] = [None] * slots
        self.versions = [0] * slots
        self._flags_sent = False
        self._starved = False  # a wait timed out: do not wait again until a slot is found free

    def take(self, nbytes: int, wait_s: float = WAIT_S) -> tuple[SlotRef, torch.Tensor] | str:
        """A free slot of at least NBYTES, marked busy: its reference and its first NBYTES as a
        uint8 tensor; or, when none frees up in time (or shared memory fails), why not."""
        slot = self._free(nbytes)
        if slot is None and not self._starved:
            deadline, pause = time.monotonic() + wait_s, 50e-6
            while slot is None and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 5e-3)
                slot = self._free(nbytes)
            if slot is None:
                self._starved = True
                return (f"a DataLoader worker found none of its {len(self.storages)} slots free for "
                        f"{wait_s:g} s (the training process holds that many of its batches), so it packed into "
                        "a fresh buffer, which the pin-memory step copies")
        if slot is None:
            return "no free slot"
        self._starved = False
        storage, new = self.storages[slot], None
        if storage is None or storage.nbytes() < nbytes:
            size = -(-(nbytes + nbytes // 4) // _GRAIN) * _GRAIN  # room for batches that vary in size
            try:
                storage = torch.UntypedStorage._new_shared(size)
            except (RuntimeError, OSError) as exc:
                return f"shared memory for a {size}-byte slot could not be made ({exc})"
            self.storages[slot], new = storage, storage
            self.versions[slot] += 1
        self._flags[slot] = _BUSY
        flags = None if self._flags_sent else self.flags
        self._flags_sent = True
        ref = SlotRef(self.id, self.owner, self.worker, slot, self.versions[slot], nbytes, new, flags)
        return ref, torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))

    def _free(self, nbytes: int) -> int | None:
        """A free slot: one already large enough if there is one, else any (made larger when taken)."""
        flags = self._flags[:]
        found = None
        for i, flag in enumerate(flags):
            if flag == _FREE:
                storage = self.storages[i]
                if storage is not None and storage.nbytes() >= nbytes:
                    return i
                if found is None:
                    found = i
        return found


# -- the training process's side -----------------------------------------------------------------

class HostRing:
    """One worker's slots as mapped in the training process, each page-locked at most once."""

    def __init__(self, ring: str, flags: torch.Tensor) -> None:
        self.id, self.flags, self.pid = ring, flags, os.getpid()
        self._flags = (ctypes.c_int32 * flags.numel()).from_address(flags.data_ptr())
        self.storages: dict[int, tuple[int, Any]] = {}  # slot -> (version, storage)
        self.pinned: dict[int, int] = {}  # slot -> address registered with cudaHostRegister
        self.refused: dict[int, str] = {}  # slot -> why cudaHostRegister refused it (this version only)

    def replace(self, slot: int, version: int, storage: Any) -> None:
        self._unpin(slot)
        self.refused.pop(slot, None)  # new memory: tried again
        self.storages[slot] = (version, storage)

    def free(self, slot: int) -> None:
        self._flags[slot] = _FREE

    def pin(self, slot: int) -> bool:
        """Page-lock SLOT's memory (once per version); False where this build or machine cannot."""
        if slot in self.pinned:
            return True
        if slot in self.refused:
            return False
        storage = self.storages[slot][1]
        why = _register(storage.data_ptr(), storage.nbytes())
        if why is not None:
            self.refused[slot] = why
            return False
        self.pinned[slot] = storage.data_ptr()
        return True

    def _unpin(self, slot: int) -> None:
        ptr = self.pinned.pop(slot, None)
        if ptr is not None:
            _unregister(ptr)

    def __del__(self) -> None:
        if self.pid != os.getpid():  # a copy inherited by a forked process: CUDA is not for it to touch
            return
        for slot in list(self.pinned):
            try:
                self._unpin(slot)
            except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
                pass


class SlotHold:
    """A batch's hold on its slot: the slot is freed when this is collected (see `receive`)."""

    __slots__ = ("ring", "slot", "storage")

    def __init__(self, ring: HostRing, slot: int, storage: Any) -> None:
        self.ring, self.slot, self.storage = ring, slot, storage

    def pin(self) -> bool:
        return self.ring.pin(self.slot)

    def __del__(self) -> None:
        try:
            if self.ring.pid == os.getpid():  # not a copy inherited by a forked process
                self.ring.free(self.slot)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_rings: dict[str, HostRing] = {}
_owned: dict[str, list[str]] = {}  # packed_collate token -> the rings of its workers
_lock = threading.Lock()


def receive(ref: SlotRef) -> tuple[torch.Tensor, SlotHold]:
    """The host buffer of a batch a worker packed into a slot, and its lease (training process).

    The buffer is a tensor over the slot's memory whose holder keeps the lease: the slot is freed
    when the buffer and every view of it are gone, never earlier.
    """
    reap()
    with _lock:
        ring = _rings.get(ref.ring)
        if ring is None:
            if ref.flags is None:
                raise PackingError(f"packed_collate: a batch came from worker ring {ref.ring}, which this process "
                                   "has not received (its first batch went elsewhere). Fix: iterate a DataLoader "
                                   "with packed_collate in one process, or pass packed_collate(slots=0).")
            ring = _rings[ref.ring] = HostRing(ref.ring, ref.flags)
            # Workers that have ended (restarted each epoch, or an iterator shut down) lose their
            # rings here; their slots go once no batch holds them. Workers of another iterator of
            # the same loader, alive at the same time, keep theirs.
            alive = [r for r in _owned.get(ref.owner, ()) if _alive(r)]
            for r in set(_owned.get(ref.owner, ())) - set(alive):
                _rings.pop(r, None)
            _owned[ref.owner] = [*alive, ref.ring]
        if ref.storage is not None:
            ring.replace(ref.slot, ref.version, ref.storage)
    version, storage = ring.storages.get(ref.slot, (None, None))
    if version != ref.version or storage is None:  # the batch that carried this version's memory never arrived here
        have = "no version" if version is None else f"version {version}"
        raise PackingError(f"packed_collate: a batch is in version {ref.version} of slot {ref.slot} of worker ring "
                           f"{ref.ring}, but this process has {have} of it (the batch that carried it went elsewhere). "
                           "Fix: iterate a DataLoader with packed_collate in one process, or pass "
                           "packed_collate(slots=0).")
    holder = (ctypes.c_uint8 * ref.nbytes).from_address(storage.data_ptr())
    lease = SlotHold(ring, ref.slot, storage)
    holder._lease = lease  # type: ignore[attr-defined]
    return torch.frombuffer(holder, dtype=torch.uint8), lease


_tokens: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()  # token -> its packed_collate


def claim(holder: Any, token: str | None = None) -> str:
    """A token naming HOLDER's rings: TOKEN, unless another live holder in this process has it.

    A DataLoader worker that unpickles a packed_collate keeps its token (its batches must name the
    training process's collate); a copy made in the process that holds the original (deepcopy,
    pickle) gets a new one, so collecting the copy (`forget`) cannot drop the original's rings.
    """
    with _lock:
        if token is None or token in _tokens:
            token = secrets.token_hex(8)
        _tokens[token] = holder
    return token


def forget(owner: str) -> None:
    """Drop the rings of OWNER (a packed_collate that is gone); batches still held keep theirs."""
    with _lock:
        for ring in _owned.pop(owner, ()):
            _rings.pop(ring, None)


def _alive(ring: str) -> bool:
    """True while the worker process that made RING (its id starts with the pid) is running."""
    try:
        os.kill(int(ring.split(".", 1)[0]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


# -- copies that read a slot -----------------------------------------------------------------------

# Held per owner: by default the thread that queued the copies, which for a DeviceLoader is its
# epoch's worker thread, so one loader's epoch end (`settle`) never waits on another's copies.
_held: dict[Any, collections.deque] = {}  # owner -> (event, host buffer): copies from the buffer in flight
_held_lock = threading.Lock()


def hold_until(event: Any, buffer: torch.Tensor, owner: Any = None) -> None:
    """Keep BUFFER (and so its slot) until EVENT, recorded after a copy that reads it, has completed.

    OWNER (default: the calling thread) is who may `settle` it; each keeps at most `_HOLD_MAX`.
    """
    oldest = None  # waited for and dropped outside the lock: its last reference may free (and unpin) a slot
    with _held_lock:
        held = _held.setdefault(threading.get_ident() if owner is None else owner, collections.deque())
        held.append((event, buffer))
        if len(held) > _HOLD_MAX:
            oldest = held.popleft()
    if oldest is not None:
        oldest[0].synchronize()
        del oldest
    reap()


def reap() -> None:
    """Let go of the buffers whose copies have completed (each owner's oldest first)."""
    if not _held:
        return
    gone = []  # dropped outside the lock: a buffer's last reference frees its slot
    with _held_lock:
        for owner, held in list(_held.items()):
            while held and held[0][0].query():
                gone.append(held.popleft())
            if not held:
                del _held[owner]
    del gone


def settle(owner: Any = None) -> None:
    """Wait for the copies OWNER (default: the calling thread) holds, and let go of their buffers
    (a loader's epoch ended); other owners' copies, another loader's, are left in flight."""
    with _held_lock:
        gone = list(_held.pop(threading.get_ident() if owner is None else owner, ()))
    for event, _ in gone:
        event.synchronize()
    del gone


# -- page-locking ------------------------------------------------------------------------------------

_cannot: list[str] = []  # why registering cannot work on this machine or build, once known
# cudaErrorInsufficientDriver, cudaErrorNoDevice, cudaErrorNotSupported: no block will ever register here
_MACHINE_CANNOT = (35, 100, 801)


def _register(ptr: int, nbytes: int) -> str | None:
    """cudaHostRegister(PTR, NBYTES): None where it worked, else why not.

    Where the machine or build cannot (no CUDA, a CPU build, no support) the reason is kept
    (`why_not_pinned`) and nothing is tried again; any other refusal (over the locked-memory
    limit, memory registered already) fails this block alone, and the CUDA runtime's error
    state is cleared, so the next CUDA call that checks it does not raise this one.
    """
    if _cannot:
        return _cannot[0]
    try:
        if not torch.cuda.is_available():  # cuda-only: page-locking in place is CUDA's cudaHostRegister
            raise RuntimeError("no CUDA device here")
        cudart = torch.cuda.cudart()  # cuda-only: CUDA's runtime, for cudaHostRegister
    except Exception as exc:  # noqa: BLE001 - a CPU build, no driver: copy instead
        _cannot.append(f"{type(exc).__name__}: {exc}")
        return _cannot[0]
    portable = 1  # cudaHostRegisterPortable: pinned for every device, not only the current one
    code = int(cudart.cudaHostRegister(ptr, nbytes, portable))  # cuda-only: CUDA's runtime
    if code == 0:
        return None
    _consume_last_error()
    why = f"cudaHostRegister: {torch.cuda.CudaError(code)}"  # cuda-only: the runtime's words for CODE
    if code in _MACHINE_CANNOT:
        _cannot.append(why)
    return why


def _consume_last_error() -> None:
    """Clear the CUDA runtime's last error on this thread, which a refused cudaHostRegister sets.

    torch binds no cudaGetLastError, but checks (and so clears) the last error after every kernel it
    launches: launch one and drop the error it reports (the registration's, already handled)."""
    try:
        torch.zeros(1, device="cuda")  # cuda-only: a kernel launch on the runtime that refused the registration
    except RuntimeError:  # torch.AcceleratorError is a RuntimeError
        pass


def _unregister(ptr: int) -> None:
    cudart = torch.cuda.cudart()  # cuda-only: undoes CUDA's cudaHostRegister
    torch.cuda.check_error(cudart.cudaHostUnregister(ptr))  # cuda-only: undoes CUDA's cudaHostRegister


def why_not_pinned() -> str | None:
    """Why slots cannot be page-locked in place here (None while they can, or before the first try)."""
    return _cannot[0] if _cannot else None


def not_pinned(lease: SlotHold) -> str:
    """What to say (once) when LEASE's slot could not be page-locked in place."""
    why = why_not_pinned()
    if why is not None:
        return (f"packed_collate could not page-lock its workers' slots in place ({why}), so the pin-memory step "
                "copies each batch into pinned memory, as with packed_collate(slots=0).")
    return (f"packed_collate could not page-lock a slot of a worker in place ({lease.ring.refused.get(lease.slot)}), "
            "so the pin-memory step copies the batches packed into it into pinned memory; its other slots are "
            "page-locked as before. Fix: raise the locked-memory limit (ulimit -l), or pass a smaller "
            "packed_collate(slots=N) or max_tensor_bytes.")
